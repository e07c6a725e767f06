"""Turning a step's logits into tokens at once: greedy, temperature, top-k, top-p, seeded.

Greedy rows take the argmax. A sampled row draws by inverse CDF with one uniform number, drawn on
the host from the request's own `random.Random` (seeded from its `seed`, or from the OS), so a
seeded request gets the same tokens whatever else is in its batch and in whatever order requests
arrive, and the device needs no generator per request and no synchronisation per row: the step's
numbers arrive in the runner's one transfer, its tokens leave with the step's. Transformations
follow transformers' order: temperature, then top-k, then top-p (the smallest set of the most
likely tokens whose mass reaches `top_p`, renormalised after top-k).

The draw walks the row in order of probability, over a candidate set: the row's `CANDIDATES` most
likely tokens (or its top-k, if larger), found with one `topk` instead of a sort of the whole
vocabulary, in float32. Exact, because the kept set and the CDF are prefixes of that order: a row
whose kept set is within its candidates (top-k, or candidates holding `top_p` of the mass) draws
among them; a row whose draw falls past them (no filter, or a flat distribution, as random
weights give) is drawn again over its whole vocabulary in the same order. Logits are shifted by
their maximum before the temperature divides them, so a tiny temperature sends the others to a
huge negative number (never inf - inf = NaN).
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


CANDIDATES = (64, 1024)
"""The candidate sets a sampled row is drawn among, smallest first, before its whole vocabulary:
`topk` over 50,257 logits takes 1.4 ms for 32 rows at 64 and 7 ms at 1,024, a full sort 57 ms,
and a trained model's top 64 usually hold a top-p 0.9 set."""

_MIN_TEMPERATURE = 1e-30  # float32 keeps it (1e-300 would round to 0 and divide 0 by 0)


def sample(logits: Tensor, sampled: SampledRows | None) -> Tensor:
    """One token id per row of `logits` [n, V], as a device tensor [n] (int64)."""
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        # torch's CPU argmax has no vectorised 16-bit path: over [32, 50257] bfloat16 logits it
        # took 2.6 ms, 10% of a decode step; widening first (exact) and taking it in float32, 0.5.
        logits = logits.float()
    tokens = logits.argmax(dim=-1)
    if sampled is None:
        return tokens
    return tokens.index_copy(0, sampled.rows, _draw(logits.index_select(0, sampled.rows).float(), sampled))


def _draw(x: Tensor, sampled: SampledRows) -> Tensor:
    """A token for each row of x (its raw logits [m, V], float32) by its parameters and uniform."""
    m, vocab = x.shape
    inv_t = 1.0 / sampled.temperature.float().clamp(min=_MIN_TEMPERATURE)
    top_k, top_p, uniform = sampled.top_k, sampled.top_p.float(), sampled.uniform.float()
    limited = top_k > 0
    first = min(CANDIDATES[0], vocab)
    raw, order = x.topk(first, dim=-1)  # temperature keeps the order: candidates from the raw logits
    # e^((x - max) / T) over the whole row once: the normaliser of rows no top-k limits, and the
    # tail a plain temperature draw may fall into.
    weights = ((x - raw[:, :1]) * inv_t[:, None]).exp_()
    total = weights.sum(dim=-1)
    drawn = torch.zeros(m, dtype=torch.long, device=x.device)
    pending = torch.ones(m, dtype=torch.bool, device=x.device)
    plain = ~limited & (top_p >= 1)  # temperature alone: past the first candidates, by index
    for k in (*(c for c in CANDIDATES if c < vocab), vocab):
        if k > first:
            rows = pending.nonzero().squeeze(1)
            if k == vocab:  # the whole vocabulary, most likely first
                raw_k, order_k = x[rows].sort(dim=-1, descending=True)
            else:
                raw_k, order_k = x[rows].topk(k, dim=-1)
        else:
            rows, raw_k, order_k = torch.arange(m, device=x.device), raw, order
        tokens, done = _among(
            (raw_k - raw_k[:, :1]) * inv_t[rows, None],
            top_k[rows],
            top_p[rows],
            uniform[rows],
            total[rows],
            complete=k == vocab,
        )
        drawn[rows] = order_k.gather(1, tokens[:, None]).squeeze(1)
        pending[rows] = ~done
        if k == first and bool((pending & plain).any()):
            tail = (pending & plain).nonzero().squeeze(1)
            drawn[tail] = _past(weights[tail], order[tail], uniform[tail], total[tail])
            pending[tail] = False
        if not bool(pending.any()):
            break
    return drawn


def _among(
    z: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor, total: Tensor, complete: bool
) -> tuple[Tensor, Tensor]:
    """Each row's draw among its k most likely tokens, whose tempered logits, shifted by the row's
    maximum, are z [m, k] (most likely first): the index drawn, and whether that draw is the
    row's (False: its kept set or its draw lies past these k; `complete`: they are the whole row)."""
    k = z.shape[1]
    limited = top_k > 0
    outside = limited[:, None] & (torch.arange(k, device=z.device)[None, :] >= top_k[:, None])
    e = z.exp().masked_fill(outside, 0.0)
    # Renormalised after top-k: over a row's top_k, else over its whole vocabulary.
    p = e / torch.where(limited, e.sum(dim=-1), total)[:, None]
    cdf = p.cumsum(dim=-1)
    # transformers' top-p: a token is kept while the mass before it is below top_p (the most
    # likely always is). Kept tokens are a prefix of this order.
    kept = p.masked_fill(cdf - p >= top_p[:, None], 0.0)
    kept_cdf = kept.cumsum(dim=-1)
    held = kept_cdf[:, -1]
    # Where no top-k limits a row and these hold less than top_p, its kept set goes on past them.
    open_ended = ~limited & (cdf[:, -1] < top_p) & (not complete)
    target = torch.where(open_ended, uniform, uniform * held)
    at = torch.searchsorted(kept_cdf, target[:, None], right=True).squeeze(1)
    last = (kept > 0).sum(dim=-1) - 1
    beyond = limited & (top_k > k)  # its top-k reaches past these
    done = ~beyond & ~(open_ended & ((top_p < 1) | (at > last)))
    return torch.minimum(at, last.clamp(min=0)), done


def _past(weights: Tensor, candidates: Tensor, uniform: Tensor, total: Tensor) -> Tensor:
    """A plain temperature draw that fell past the row's candidates: among the other tokens, by
    index, with the mass the candidates leave (weights [m, V] unnormalised, candidates [m, c])."""
    rest = weights.scatter(1, candidates, 0.0)
    left = rest.sum(dim=-1)
    # The part of the draw past the candidates' mass, on the rest's scale.
    target = (uniform * total - (total - left)).clamp(min=0.0)
    at = torch.searchsorted(rest.cumsum(dim=-1), target[:, None], right=True).squeeze(1)
    return torch.minimum(at, torch.full_like(at, weights.shape[1] - 1))
