"""The worker's configuration: one frozen dataclass; `worker serve` flags are generated from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from govwire.address import parse_address
from govwire.auth import SharedSecret
from govwire.logs import LogFormat
from govwire.options import ConfigError, option
from govwire.vocab import WORKER_TOKEN_ENV

RANDOM_GPT2 = "random-gpt2"
RANDOM_TINY = "random-tiny"
RANDOM_MODELS = (RANDOM_GPT2, RANDOM_TINY)  # embedded: no files (loading.py builds them)


@dataclass(frozen=True)
class WorkerConfig:
    listen: str = option("127.0.0.1:7071", "where to accept governor links: unix:PATH or HOST:PORT")
    engine: Literal["gpt2", "echo"] = option(
        "gpt2", "what generates tokens: the GPT-2 engine, or an echo of the prompt"
    )
    model: str = option(
        "random-gpt2",
        "gpt2: a local Hugging Face GPT-2 directory, or random-gpt2 (GPT-2 small, random weights) / random-tiny",
        metavar="PATH",
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", "gpt2: where the model runs; auto = cuda when available")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = option(
        "auto",
        "gpt2: weights and KV cache type; auto = bfloat16 on cuda, and on a cpu that runs it natively"
        " (AVX512-BF16 or AMX), else float32",
    )
    quantize: Literal["none", "int8"] = option(
        "none",
        "gpt2: int8 = the linear layers' and the LM head's weights in int8 (per output channel; activations"
        " quantized per row each call) in a C kernel built for the CPU; embeddings and layer norms in float32,"
        " the KV cache as --kv-cache-dtype says; cpu only, with --dtype float32 or auto; refused at start where"
        " the kernel cannot be built",
    )
    max_batch_size: int = option(32, "gpt2: the decode batch: most decoding sequences in one step")
    max_running: int = option(
        0, "gpt2: most admitted requests (holding KV); above --max-batch-size they take turns; 0 = --max-batch-size"
    )
    prefill_max_batch_size: int = option(0, "gpt2: most waiting requests admitted per step; 0 = --max-batch-size")
    max_prefill_tokens: int = option(
        0,
        "gpt2: prompt tokens per step, beside the decodes; longer prompts are prefilled in chunks while the"
        " running streams go on; 0 = 2048 while nothing decodes and, beside decoding streams, on the cpu a budget"
        " learned to keep a step within 1.8 decode-only steps (never below 64), on cuda 2048",
    )
    kv_cache_tokens: int = option(
        16384, "gpt2: KV cache size in tokens, allocated once in blocks; requests wait while their blocks do not fit"
    )
    kv_block_size: int = option(16, "gpt2: tokens per KV cache block (the unit of paging and of prefix reuse)")
    prefix_caching: bool = option(
        True,
        "gpt2: reuse the cached KV blocks of a prompt's longest known prefix (full blocks only);"
        " --no-prefix-caching: prefill every prompt whole",
    )
    kv_reservation: Literal["paged", "worst-case"] = option(
        "paged",
        "gpt2: paged = blocks as a sequence grows, preempting the newest when the cache runs dry;"
        " worst-case = blocks for prompt + max_new_tokens at admission, never preempted",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        "gpt2: the KV cache's dtype (attention reads and computes in it); auto = the model's, except with"
        " --quantize int8 on a CPU with native bfloat16, where it is bfloat16: half the bytes each decode step reads",
    )
    threads: int = option(0, "gpt2: torch CPU threads; 0 = torch's default (the physical cores)")
    cuda_graphs: bool = option(
        True, "gpt2: on cuda, replay decode steps from CUDA graphs captured at start; --no-cuda-graphs: all eager"
    )
    async_scheduling: Literal["auto", "on", "off"] = option(
        "auto",
        "gpt2: launch the next step before reading the last one's tokens, so host work (scheduling,"
        " detokenizing, sending) overlaps the device's; auto = on for cuda, off on the cpu (the cpu is the device)",
    )
    tokenizer_nice: int = option(
        10,
        "gpt2: niceness of the thread that tokenizes prompts (Linux), so that on a CPU-bound worker running"
        " streams get the cores first; 0 = the engine's own priority",
    )
    token_delay_ms: float = option(0.0, "echo: delay between consecutive tokens")
    first_token_delay_ms: float = option(0.0, "echo: delay before the first token")
    stats_interval_s: float = option(1.0, "how often engine statistics are pushed to connected governors")
    auth_token_file: str = option(
        "",
        "links must open with an auth frame carrying this file's secret (the governor's"
        " --worker-auth-token-file); a spawned worker takes its secret from $GOVERNOR_WORKER_TOKEN",
        metavar="PATH",
    )
    drain_timeout_s: float = option(
        30.0, "on SIGTERM, how long running requests may finish (new ones are refused) before the rest are cancelled"
    )
    parent_pid: int = option(0, "exit when this process is gone (set by a spawning governor); 0 = never")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log verbosity")
    log_format: LogFormat = option("logfmt", "log lines as logfmt (key=value) or as JSON objects")

    def __post_init__(self) -> None:
        try:
            parse_address(self.listen)
        except ValueError as exc:
            raise ConfigError(f"--listen: {exc}") from None
        if self.token_delay_ms < 0 or self.first_token_delay_ms < 0:
            raise ConfigError("--token-delay-ms and --first-token-delay-ms must be >= 0")
        for name in ("max_batch_size", "kv_cache_tokens", "kv_block_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.kv_cache_tokens < self.kv_block_size:
            raise ConfigError("--kv-cache-tokens must hold at least one block of --kv-block-size tokens")
        if min(self.prefill_max_batch_size, self.max_running, self.threads, self.max_prefill_tokens) < 0:
            raise ConfigError(
                "--prefill-max-batch-size, --max-running, --threads and --max-prefill-tokens must be >= 0"
            )
        if not 0 <= self.tokenizer_nice <= 19:
            raise ConfigError("--tokenizer-nice must be between 0 and 19")
        self.check_model_path()
        if self.stats_interval_s <= 0:
            raise ConfigError("--stats-interval-s must be > 0")
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ConfigError("--drain-timeout-s must be finite and >= 0")
        self.secret()

    def check_model_path(self) -> None:
        """A --model that is not an embedded one must be a directory with a config.json: checked
        here, before torch is imported (seconds of CPU), so a typo fails at once."""
        if self.engine != "gpt2" or self.model in RANDOM_MODELS:
            return
        path = Path(self.model)
        if not path.is_dir():
            raise ConfigError(f"--model {self.model!r}: no such directory (or use one of {', '.join(RANDOM_MODELS)})")
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {self.model!r}: no config.json in it (a Hugging Face GPT-2 directory has one)")

    def secret(self) -> SharedSecret | None:
        try:
            if self.auth_token_file:
                return SharedSecret.read(self.auth_token_file)
            token = os.environ.get(WORKER_TOKEN_ENV)
            return None if token is None else SharedSecret.from_text(token, f"${WORKER_TOKEN_ENV}")
        except ValueError as exc:
            raise ConfigError(f"--auth-token-file: {exc}") from None
