"""A loaded model's teacher-forced logits, and its perplexity on held-out text: what the dtype
check (benchmarks/engine/dtypes.py) and the comparison with llama.cpp's Q8_0
(benchmarks/peers/llamacpp_perplexity.py) both read."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from benchmarks.harness import model_dir
from benchmarks.harness.results import Sitting
from worker.attention import Segment
from worker.kv_cache import KVCache
from worker.loading import LoadedModel
from worker.model import PackedBatch

PERPLEXITY_WITHIN = 0.01
"""A quantized or lower-precision model's held-out perplexity is held within 1% of float32's."""

PERPLEXITY_WINDOWS = 16


@torch.inference_mode()
def teacher_forced_logits(loaded: LoadedModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits [L, V] at every position of each sequence, from one causal forward each (the
    KV cache in the loaded model's `kv_dtype`, as the worker keeps it)."""
    param = next(loaded.model.parameters())
    cache = KVCache(loaded.shape, max(map(len, sequences)), 1, loaded.kv_dtype, param.device)  # blocks of one row
    out = []
    for ids in sequences:
        n = len(ids)
        rows = torch.arange(n, device=param.device)
        batch = PackedBatch(torch.tensor(ids, device=param.device), rows, rows, None, [Segment(0, n, 0, n)], None, None)
        out.append(loaded.model(batch, cache).float().cpu())
    return out


def held_out_windows(loaded: LoadedModel, windows: int = PERPLEXITY_WINDOWS) -> list[list[int]]:
    """`windows` consecutive windows of held-out text (`model_dir.held_out`: the corpus past what the
    trained model learnt from), each as long as the trained model's context (at most the model's)."""
    size = min(model_dir.TRAINED_CONTEXT, loaded.shape.n_positions)
    ids = [i for text in model_dir.held_out() for i in loaded.tokenizer.encode(text)]
    if len(ids) < size * windows:
        raise SystemExit(f"held-out text: {len(ids)} tokens, fewer than {windows} windows of {size}")
    return [ids[k * size : (k + 1) * size] for k in range(windows)]


def perplexity(loaded: LoadedModel, windows: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of each window's next tokens, teacher-forced."""
    nll, count = 0.0, 0
    for ids, logits in zip(windows, teacher_forced_logits(loaded, windows), strict=True):
        nll += float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


def perplexity_figure(sitting: Sitting, name: str, value: float, float32: float, note: str = "") -> None:
    """A held-out perplexity as a figure against float32's, held within `PERPLEXITY_WITHIN`."""
    sitting.figure(
        name,
        value,
        "",
        baseline=("float32", float32),
        bar=f"within {PERPLEXITY_WITHIN:.0%}",
        met=abs(value / float32 - 1.0) <= PERPLEXITY_WITHIN,
        headline=False,
        note=note,
    )
