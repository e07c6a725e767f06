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
    logits = logits.float() / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first is always kept).
        drop = probs.cumsum(dim=-1) - probs > p.top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).item())
