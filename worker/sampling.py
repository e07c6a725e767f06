"""Turning a step's logits into tokens at once: greedy, temperature, top-k, top-p, seeded.

Greedy rows take the argmax. A sampled row draws by inverse CDF with one uniform number, drawn on
the host from the request's own `random.Random` (seeded from its `seed`, or from the OS), so a
seeded request gets the same tokens whatever else is in its batch and in whatever order requests
arrive, and the device needs no generator per request and no synchronisation per row: the step's
numbers arrive in the runner's one transfer, its tokens leave with the step's (on a GPU nothing
here waits for the device: see `_draw`). Transformations follow transformers' order: temperature,
then top-k (every token as likely as the k-th, ties included), then top-p (the smallest set of
the most likely tokens whose mass reaches `top_p`, renormalised after top-k).

The draw walks the row in order of probability, over candidate sets: the row's 64 most likely
tokens, then its 1,024 (`CANDIDATES`), each found with one `topk` instead of a sort of the whole
vocabulary, in float32. Exact, because the kept set and the CDF are prefixes of that order: a row
whose kept set is within its candidates (a top-k, or candidates holding `top_p` of the mass)
draws among them; a row whose top-p set or top-k reaches past them (a flat distribution, as
random weights give) is drawn again over the next set, and last over its whole vocabulary,
sorted. A plain temperature draw (no top-k, no top-p) that falls past the first 64 walks the
other tokens by index instead, which needs no sort. Logits are shifted by their maximum before
the temperature divides them, so a tiny temperature sends the others to a huge negative number
(never inf - inf = NaN).

On the CPU both are C (worker/kernels/): the greedy rows' argmax on the logits' own dtype, and
the same draw without any sort (kernels/draw.c: a row's likely tokens are listed as it is
weighed, and a flat row is bucketed by weight), which orders tied tokens by id; torch's topk and
sort, elsewhere, order them as they find them: the same distribution, not always the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from worker.kernels.argmax import cpu_argmax
from worker.kernels.draw import cpu_draw


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
_BELOW_ONE = 1 - 2**-24  # the largest float32 below 1


def sample(logits: Tensor, sampled: SampledRows | None, sync_free: bool | None = None) -> Tensor:
    """One token id per row of `logits` [n, V], as a device tensor [n] (int64). `sync_free`: never
    wait for the device (None: everywhere but on the CPU; see `_draw`)."""
    on_cpu = logits.device.type == "cpu"
    kernel = cpu_argmax() if on_cpu else None
    if kernel is not None and logits.dtype in kernel.dtypes and logits.stride(-1) == 1:
        # Over [32, 50257] logits on a 2-core Zen 4: 0.08 ms, against torch's 0.76 in float32 and
        # 0.92 in bfloat16 (widened first: its 16-bit argmax is scalar, 2.9 ms). kernels/argmax.c.
        tokens = kernel(logits)
    else:
        tokens = (logits.float() if on_cpu else logits).argmax(dim=-1)
    if sampled is None:
        return tokens
    if sync_free is None:
        sync_free = logits.device.type != "cpu"
    drawn = _draw(logits.index_select(0, sampled.rows).float(), sampled, sync_free)
    return tokens.index_copy(0, sampled.rows, drawn)


def _draw(x: Tensor, sampled: SampledRows, sync_free: bool) -> Tensor:
    """A token for each row of x (its raw logits [m, V], float32) by its parameters and uniform.

    On the CPU, rows move to the next candidate set only as needed (a branch on the data costs
    nothing there). `sync_free` (any other device), nothing here may wait for the device, since the
    engine launches the next step while this one runs: every row goes through the first set, plain rows through the
    rest by index, and the whole vocabulary is sorted whenever a row could need it (a top-p, or a
    top-k past the first set), the per-row choice made with `torch.where`."""
    m, vocab = x.shape
    inv_t = 1.0 / sampled.temperature.float().clamp(min=_MIN_TEMPERATURE)
    kernel = None if sync_free or not x.is_cpu else cpu_draw()
    if kernel is not None:  # the same draw without sorting a flat row: kernels/draw.c
        return kernel(x, inv_t, sampled.top_k, sampled.top_p, sampled.uniform)
    top_k, top_p = sampled.top_k, sampled.top_p.float()
    uniform = sampled.uniform.float().clamp(max=_BELOW_ONE)  # float32 may round a uniform up to 1
    plain = (top_k <= 0) & (top_p >= 1)  # temperature alone: past the first candidates, by index
    first = min(CANDIDATES[0], vocab)
    raw, order = x.topk(first, dim=-1)  # temperature keeps the order: candidates from the raw logits
    # e^((x - max) / T) over the whole row once: the normaliser of rows no top-k limits, and the
    # rest a plain temperature draw may fall into.
    weights = ((x - raw[:, :1]) * inv_t[:, None]).exp_()
    total = weights.sum(dim=-1)
    drawn, done = _stage(raw, order, inv_t, top_k, top_p, uniform, total, first == vocab)
    if sync_free:
        drawn = torch.where(done | ~plain, drawn, _past(weights, order, uniform, total))
        if sampled.any_top_p or sampled.max_top_k > first:
            raw_all, order_all = x.sort(dim=-1, descending=True)
            whole, _ = _stage(raw_all, order_all, inv_t, top_k, top_p, uniform, total, True)
            drawn = torch.where(done | plain, drawn, whole)
        return drawn
    if bool((~done & plain).any()):
        tail = (~done & plain).nonzero().squeeze(1)
        drawn[tail] = _past(weights[tail], order[tail], uniform[tail], total[tail])
        done[tail] = True
    for k in (*(c for c in CANDIDATES[1:] if c < vocab), vocab):
        if bool(done.all()):
            break
        rows = (~done).nonzero().squeeze(1)
        if k == vocab:  # the whole vocabulary, most likely first
            raw_k, order_k = x[rows].sort(dim=-1, descending=True)
        else:
            raw_k, order_k = x[rows].topk(k, dim=-1)
        tokens, now_done = _stage(
            raw_k, order_k, inv_t[rows], top_k[rows], top_p[rows], uniform[rows], total[rows], k == vocab
        )
        drawn[rows] = tokens
        done[rows] = now_done
    return drawn


def _stage(
    raw: Tensor,
    order: Tensor,
    inv_t: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    uniform: Tensor,
    total: Tensor,
    complete: bool,
) -> tuple[Tensor, Tensor]:
    """Each row's draw among its k most likely tokens (raw logits [m, k] and their ids, most likely
    first), and whether that draw is the row's: False where its kept set or its draw lies past
    these k (`complete`: they are the whole row)."""
    z = (raw - raw[:, :1]) * inv_t[:, None]
    k = z.shape[1]
    limited = top_k > 0
    # transformers' top-k keeps every token as likely as the k-th: ties included.
    kth = z.gather(1, (top_k.clamp(1, k) - 1)[:, None])
    outside = limited[:, None] & (z < kth)
    e = z.exp().masked_fill(outside, 0.0)
    # Renormalised after top-k: over a row's top-k, else over its whole vocabulary.
    p = e / torch.where(limited, e.sum(dim=-1), total)[:, None]
    cdf = p.cumsum(dim=-1)
    # transformers' top-p: a token is kept while the mass before it is below top_p (the most
    # likely always is). Kept tokens are a prefix of this order.
    kept = p.masked_fill(cdf - p >= top_p[:, None], 0.0)
    kept_cdf = kept.cumsum(dim=-1)
    held = kept_cdf[:, -1]
    # Where no top-k limits a row and these hold less than top_p, its kept set goes on past them;
    # a top-k goes on past them when it is larger, or when its ties reach their end.
    open_ended = ~limited & (cdf[:, -1] < top_p) & (not complete)
    beyond = limited & ((top_k > k) | (z[:, -1] >= kth.squeeze(1))) & (not complete)
    target = torch.where(open_ended, uniform, uniform * held)
    at = torch.searchsorted(kept_cdf, target[:, None], right=True).squeeze(1)
    last = (kept > 0).sum(dim=-1) - 1
    done = ~beyond & ~(open_ended & ((top_p < 1) | (at > last)))
    at = torch.minimum(at, last.clamp(min=0))
    return order.gather(1, at[:, None]).squeeze(1), done


def _past(weights: Tensor, candidates: Tensor, uniform: Tensor, total: Tensor) -> Tensor:
    """A plain temperature draw that fell past the row's candidates: among the other tokens, by
    index, with the mass the candidates leave (weights [m, V] unnormalised, candidates [m, c],
    most likely first). Where the others hold no mass at all (masked, or underflowed at a low
    temperature), the least likely candidate that has some: never a token of probability 0."""
    rest = weights.scatter(1, candidates, 0.0)
    cdf = rest.cumsum(dim=-1)
    end = cdf[:, -1]
    # The part of the draw past the candidates' mass, on the rest's scale, kept below its end.
    target = (uniform * total - (total - end)).clamp(min=0.0)
    target = torch.minimum(target, end * _BELOW_ONE)
    at = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp(max=weights.shape[1] - 1)
    weighted = (weights.gather(1, candidates) > 0).sum(dim=-1, keepdim=True).clamp(min=1)
    fallback = candidates.gather(1, weighted - 1).squeeze(1)
    return torch.where(end > 0, at, fallback)
