"""Model and tokenizer loading: a local Hugging Face GPT-2 directory, or an embedded random model.

Offline by construction: `HF_HUB_OFFLINE` is set before transformers is imported and every call
passes `local_files_only=True`, so nothing is ever fetched from a hub.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker import int8
from worker.config import RANDOM_GPT2, RANDOM_MODELS
from worker.errors import ModelLoadError
from worker.model import GPT2, can_pack_for_cpu
from worker.model_shape import GPT2Shape
from worker.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
log = logging.getLogger("worker.loading")

RANDOM_SEED = 0
# oneDNN lays out packed weights for about this many rows; one layout served 1 to 2,048 rows
# within a few percent of the best per size (model.py), so the decode batch default is used.
PACK_BATCH_HINT = 32
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: GPT2
    tokenizer: Tokenizer
    shape: GPT2Shape
    kv_dtype: torch.dtype  # the KV cache's (resolve_kv_dtype): engines and benchmarks built on it use it


def random_config(name: str) -> Any:
    """GPT-2 small's architecture (`GPT2Config()` defaults), or a 2-layer toy over bytes."""
    from transformers import GPT2Config

    if name == RANDOM_GPT2:
        return GPT2Config()
    # 256 byte tokens + end-of-text: the byte tokenizer covers the whole vocabulary.
    return GPT2Config(
        vocab_size=257, n_positions=1024, n_embd=64, n_layer=2, n_head=4, bos_token_id=256, eos_token_id=256
    )


def load_hf_model(spec: str) -> tuple[Any, Tokenizer]:
    """The transformers `GPT2LMHeadModel` (float32, CPU, eval) and tokenizer that `spec` names.

    Random models get seeded weights from transformers' own initialisation, so the engine, the
    tests and the benchmark's HF baselines all see the same weights.
    """
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel

    if spec in RANDOM_MODELS:
        config = random_config(spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            model = GPT2LMHeadModel(config)
        return model.eval(), ByteTokenizer(config.vocab_size, config.eos_token_id)
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"--model {spec!r}: no such directory (or use one of {', '.join(RANDOM_MODELS)})")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--model {spec!r}: cannot read config.json: {exc}") from None
    if config.model_type != "gpt2":
        raise ModelLoadError(f"--model {spec!r}: model_type is {config.model_type!r}, this engine runs gpt2")
    unsupported = unsupported_options(config)
    if unsupported:
        raise ModelLoadError(f"--model {spec!r}: this engine does not implement {', '.join(unsupported)}")
    try:
        model = GPT2LMHeadModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return model.eval(), HFTokenizer(tokenizer)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--model {spec!r}: {exc}") from None


# GPT-2 options that change the forward pass, with the values the engine implements: a checkpoint
# that sets another would run without error and produce wrong text.
SUPPORTED_OPTIONS: dict[str, tuple[object, ...]] = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # the tanh approximation
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
}


def unsupported_options(config: Any) -> list[str]:
    return [
        f"{name}={getattr(config, name)!r}"
        for name, values in SUPPORTED_OPTIONS.items()
        if getattr(config, name, values[0]) not in values
    ]


def load(
    spec: str, device: torch.device, dtype: torch.dtype, quantize: str = "none", kv_cache_dtype: str = "auto"
) -> LoadedModel:
    """The model of `spec` on `device` in `dtype`; `quantize="int8"`: its linear layers' weights in
    int8 (worker/int8.py), refused where they cannot run (a GPU, a dtype other than float32, no C
    compiler for the kernel): never a quiet fallback to float32."""
    if quantize == "int8":
        why = int8_refusal(device, dtype)
        if why:
            raise ModelLoadError(f"--quantize int8: {why}")
    hf_model, tokenizer = load_hf_model(spec)
    shape = GPT2Shape.from_config(hf_model.config)
    if tokenizer.vocab_size > shape.vocab_size:
        # Prompt ids past the embedding would fail every step they are in (a sticky assert on CUDA).
        raise ModelLoadError(
            f"--model {spec!r}: the tokenizer has {tokenizer.vocab_size} tokens, "
            f"the model's vocabulary only {shape.vocab_size}"
        )
    model = GPT2(shape)
    model.load_hf_state_dict(hf_model.state_dict())
    del hf_model
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if quantize == "int8":
        model.quantize_int8()
    if device.type == "cpu" and can_pack_for_cpu(dtype):
        model.pack_for_cpu(PACK_BATCH_HINT)
    return LoadedModel(model, tokenizer, shape, resolve_kv_dtype(kv_cache_dtype, device, dtype, quantize))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: CUDA is not available on this machine")
    return torch.device(name)


def int8_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int8 linear layers cannot run here (None: they can)."""
    if device.type != "cpu":
        return f"int8 weights run on the cpu, not {device.type}"
    if dtype != torch.float32:
        return f"int8 weights run with --dtype float32 (or auto), not {str(dtype).removeprefix('torch.')}"
    return int8.unsupported()


def resolve_dtype(name: str, device: torch.device, quantize: str = "none") -> torch.dtype:
    """`auto`: bfloat16 on CUDA (float16 on GPUs without it); on a CPU, bfloat16 where the CPU runs
    it natively, else float32. Where bfloat16 is only emulated (AVX2 machines) it is not a little
    slower but about a hundred times (docs/benchmarks/sittings.md), and float16 on CPUs is native only on
    the same AMX parts that run bfloat16, which keeps float32's range; so auto picks bfloat16 or
    float32. The accuracy check behind that choice is in docs/benchmarks/sittings.md (benchmarks/engine/dtypes.py).
    With `--quantize int8`, auto is float32: the int8 layers take and give float32."""
    if name != "auto":
        return DTYPES[name]
    if quantize == "int8":
        return torch.float32
    if device.type == "cuda":
        chosen, why = (
            (torch.bfloat16, "cuda") if torch.cuda.is_bf16_supported() else (torch.float16, "cuda without bf16")
        )
    elif cpu_runs_bfloat16_natively():
        chosen, why = torch.bfloat16, "cpu with native bfloat16 (avx512_bf16 or amx)"
    else:
        chosen, why = torch.float32, "cpu without native bfloat16 (no avx512_bf16 or amx)"
    log.info("event=dtype_auto dtype=%s reason=%r", str(chosen).removeprefix("torch."), why)
    return chosen


def resolve_kv_dtype(name: str, device: torch.device, dtype: torch.dtype, quantize: str = "none") -> torch.dtype:
    """`auto`: the model's dtype, except with `--quantize int8` on a CPU that runs bfloat16
    natively: bfloat16. A decode step reads every cached key and value; with int8 layers that was a
    fifth of GPT-2 small's served step (float32 KV, batch 32, a 2-core Zen 4), and in bfloat16 it
    reads half the bytes: served tok/s 1.05x (uniform) and 1.13-1.17x (mixed) the float32 cache's
    there in two sittings, held-out perplexity unchanged (benchmarks.peers.cpu_engines,
    benchmarks.engine.dtypes).
    Elsewhere the KV cache stays in the dtype its attention has been measured in."""
    if name != "auto":
        return DTYPES[name]
    if quantize == "int8" and device.type == "cpu" and cpu_runs_bfloat16_natively():
        return torch.bfloat16
    return dtype


def cpu_runs_bfloat16_natively() -> bool:
    """AVX512-BF16 or AMX-BF16 dot products, and oneDNN's bfloat16 path for the linear layers."""
    cpu = getattr(torch, "cpu", None)
    native = any(
        getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )
    return native and can_pack_for_cpu(torch.bfloat16)
