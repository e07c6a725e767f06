"""Turning logits into tokens, per request: greedy, temperature, top-k, top-p, seeded.

Each sampled sequence draws from its own `torch.Generator`, seeded from the request's `seed`
(or from the OS when none is given), so a seeded request gets the same tokens whatever else is in
its batch and in whatever order requests arrive. Transformations follow transformers' order:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

from worker.sequence import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [n, V]; `generators[i]` is None exactly for greedy rows."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if generator is not None:
            tokens[row] = _sample_row(logits[row], p, generator)
    return tokens


def _sample_row(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    # Shifted so the largest logit is 0: a tiny temperature then sends the others to -inf, never
    # to inf - inf = NaN (which would make multinomial raise and fail the whole step).
    logits = logits.float()
    logits = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        # transformers' TopPLogitsWarper: ascending order, drop the tokens whose cumulative mass
        # stays within 1 - top_p; the most likely token is always kept.
        sorted_logits, order = torch.sort(logits)
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.top_p
        drop[-1] = False
        logits = logits.index_fill(0, order[drop], float("-inf"))
    # Inverse-CDF draw: one uniform number per token instead of the vocabulary-sized exponential
    # draw torch.multinomial makes (measured 1 ms per row for GPT-2's 50,257 logits on CPU).
    # Float64 keeps the CDF exact enough that filtered tokens (probability 0) cannot be hit.
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=cdf.device) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True).item())
    return index if index < cdf.numel() else int(logits.argmax().item())  # u rounded up to the total
