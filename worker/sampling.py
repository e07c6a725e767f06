"""Turning a step's logits into tokens at once: greedy, temperature, top-k, top-p, seeded.

Greedy rows take the argmax. A sampled row draws by inverse CDF with one uniform number, drawn on
the host from the request's own `random.Random` (seeded from its `seed`, or from the OS), so a
seeded request gets the same tokens whatever else is in its batch and in whatever order requests
arrive, and the device needs no generator per request and no synchronisation per row: the step's
numbers arrive in the runner's one transfer, its tokens leave in one `.tolist()`. Transformations
follow transformers' order: temperature, then top-k, then top-p; they run in float64, so a tiny
temperature sends the other logits to a huge negative number (never to inf - inf = NaN) and
filtered tokens (probability 0) cannot be hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class SampledRows:
    """The rows of a step's logits that are drawn, with their parameters (device tensors, [m] each)."""

    rows: Tensor  # int64: row of the logits
    temperature: Tensor  # float64, > 0
    top_k: Tensor  # int64: keep the k most likely; 0 = off
    top_p: Tensor  # float64: keep the smallest set holding this mass; 1 = off
    uniform: Tensor  # float64 in [0, 1)
    max_top_k: int  # the largest top_k (0: no row filters by top-k)
    any_top_p: bool


def sample(logits: Tensor, sampled: SampledRows | None) -> Tensor:
    """One token id per row of `logits` [n, V], as a device tensor [n] (int64)."""
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        # torch's CPU argmax has no vectorised 16-bit path: over [32, 50257] bfloat16 logits it
        # took 2.6 ms, 10% of a decode step; widening first (exact) and taking it in float32, 0.5.
        logits = logits.float()
    tokens = logits.argmax(dim=-1)
    if sampled is None:
        return tokens
    x = logits.index_select(0, sampled.rows).double()
    x = (x - x.max(dim=-1, keepdim=True).values) / sampled.temperature[:, None]
    minus_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if sampled.max_top_k:
        top = x.topk(sampled.max_top_k, dim=-1).values  # [m, kmax], descending
        kth = top.gather(1, (sampled.top_k.clamp(min=1) - 1)[:, None])  # [m, 1]
        threshold = torch.where(sampled.top_k[:, None] > 0, kth, minus_inf)
        x = x.masked_fill(x < threshold, float("-inf"))
    if sampled.any_top_p:
        # transformers' TopPLogitsWarper: ascending order, drop the tokens whose cumulative mass
        # stays within 1 - top_p; the most likely token is always kept.
        ascending, order = x.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - sampled.top_p)[:, None]
        drop[:, -1] = False
        x = x.scatter(1, order, ascending.masked_fill(drop, float("-inf")))
    cdf = x.softmax(dim=-1).cumsum(dim=-1)  # [m, V]
    u = (sampled.uniform * cdf[:, -1])[:, None]
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(1)
    drawn = torch.where(drawn < cdf.shape[1], drawn, x.argmax(dim=-1))  # u rounded up to the total
    return tokens.index_copy(0, sampled.rows, drawn)
