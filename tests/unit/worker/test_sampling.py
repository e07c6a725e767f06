"""Sampling a step at once: greedy rows, filters, seeded draws."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from worker.sampling import CANDIDATES, SampledRows, sample


def rows(n: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> SampledRows:
    """Every one of n rows drawn with the same parameters and its own uniform from `seed`."""
    rng = random.Random(seed)
    return SampledRows(
        rows=torch.arange(n),
        temperature=torch.full((n,), temperature, dtype=torch.float64),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p, dtype=torch.float64),
        uniform=torch.tensor([rng.random() for _ in range(n)], dtype=torch.float64),
        max_top_k=top_k,
        any_top_p=top_p < 1,
    )


def draw(logits: torch.Tensor, n: int = 200, **params: float) -> list[int]:
    tokens: list[int] = sample(logits.expand(n, -1), rows(n, **params)).tolist()  # type: ignore[arg-type]
    return tokens


def test_greedy_rows_take_the_argmax_and_only_the_drawn_rows_are_drawn() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert sample(logits, None).tolist() == [1, 0, 0]
    only_last = SampledRows(
        rows=torch.tensor([2]),
        temperature=torch.tensor([1.0], dtype=torch.float64),
        top_k=torch.tensor([0]),
        top_p=torch.tensor([1.0], dtype=torch.float64),
        uniform=torch.tensor([0.99], dtype=torch.float64),  # the last third of a flat distribution
        max_top_k=0,
        any_top_p=False,
    )
    assert sample(logits, only_last).tolist() == [1, 0, 2]


def test_top_k_and_top_p_never_sample_outside_their_set() -> None:
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0, -1.0, -2.0]])
    assert set(draw(logits, top_k=2)) == {0, 1}
    # The first token holds 0.34 of the mass, the first two 0.65: top_p 0.5 keeps tokens 0 and 1.
    assert set(draw(logits, top_p=0.5)) == {0, 1}
    assert set(draw(logits, top_p=0.01)) == {0}
    assert set(draw(logits, top_k=3, top_p=0.5)) == {0, 1}
    assert len(set(draw(logits, temperature=5.0))) == 6


def test_rows_with_different_filters_in_one_batch_keep_their_own() -> None:
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0, -1.0, -2.0]]).expand(400, -1)
    rng = random.Random(5)
    mixed = SampledRows(
        rows=torch.arange(400),
        temperature=torch.full((400,), 1.0, dtype=torch.float64),
        top_k=torch.tensor([1, 0] * 200),
        top_p=torch.tensor([1.0, 0.5] * 200, dtype=torch.float64),
        uniform=torch.tensor([rng.random() for _ in range(400)], dtype=torch.float64),
        max_top_k=1,
        any_top_p=True,
    )
    tokens = sample(logits, mixed).tolist()
    assert set(tokens[0::2]) == {0} and set(tokens[1::2]) == {0, 1}


def test_the_same_uniforms_give_the_same_draws_and_others_differ() -> None:
    logits = torch.zeros(1, 50)
    a = draw(logits, 30, seed=123)
    assert a == draw(logits, 30, seed=123)
    assert a != draw(logits, 30, seed=124)


def test_a_vanishing_temperature_samples_the_argmax_instead_of_failing() -> None:
    # Dividing raw logits by 1e-300 overflows to inf; inf - inf is NaN, which no draw survives.
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert set(draw(logits, 20, temperature=1e-300)) == {1}


def test_greedy_over_16_bit_logits_is_the_argmax_of_their_exact_float32_values() -> None:
    """On the CPU 16-bit logits are widened before the argmax (torch's 16-bit argmax is slow
    there): the widening is exact, so the tokens are the 16-bit argmax, ties to the first index."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        logits = torch.randn(8, 1000, generator=g).to(dtype)
        logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
        tokens = sample(logits, None)
        assert tokens.tolist() == logits.float().argmax(dim=-1).tolist()
        assert tokens[3].item() == 10 and tokens.dtype == torch.int64


def reference_interval(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, token: int
) -> tuple[float, float]:
    """The CDF interval [lo, hi) of `token` under transformers' filters, in float64: a draw with
    uniform u is exact when u falls in its token's interval. The CDF walks the row most likely
    first; a plain temperature draw walks its 64 most likely, then the others by index."""
    x = (row.double() - row.double().max()) / temperature
    order = torch.argsort(x, descending=True, stable=True)
    if not top_k and top_p >= 1 and len(order) > CANDIDATES[0]:
        first = order[: CANDIDATES[0]]
        rest = torch.ones(len(order), dtype=torch.bool)
        rest[first] = False
        order = torch.cat([first, rest.nonzero().squeeze(1)])
    if top_k:  # transformers' top-k: every token as likely as the k-th, ties included
        order = order[x[order] >= x[order[top_k - 1]]]
    p = torch.softmax(x[order], dim=0)
    kept = (p.cumsum(0) - p) < top_p
    q = torch.where(kept, p, torch.zeros_like(p))
    q = q / q.sum()
    cdf = q.cumsum(0)
    where = (order == token).nonzero()
    if not len(where) or not kept[where[0, 0]]:
        return (2.0, 2.0)  # outside the kept set: no uniform maps to it
    i = int(where[0, 0])
    return (float(cdf[i - 1]) if i else 0.0, float(cdf[i]))


@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([50, 3000, 5000]),  # 5,000: a flat row lists more likely tokens than the C sampler keeps
    st.sampled_from([0.05, 1.0, 3.0, 8.0]),  # how peaked: flat rows take the whole-vocabulary path
    st.sampled_from([0.7, 1.0, 1.5]),
    st.sampled_from([0, 1, 5, 2000]),
    st.sampled_from([1.0, 0.9, 0.3]),
    st.sampled_from(["kernel", "torch", "sync_free"]),
    st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_every_draw_is_the_token_whose_cdf_interval_holds_its_uniform(
    seed: int, vocab: int, spread: float, temperature: float, top_k: int, top_p: float, path: str, bf16: bool
) -> None:
    """On each of the three paths (the CPU's C sampler; torch's, where no compiler built it:
    candidates first, the whole vocabulary when a draw falls past them; and the one a GPU takes,
    which never waits for the device) the token is the one float64 inverse-CDF sampling picks
    (within float32's rounding of the CDF). bfloat16 logits (widened) bring ties by the hundred:
    the C sampler orders tied tokens by id, as the reference does; torch's topk and sort order
    them as they find them, which draws from the same distribution but not the same token."""
    assume(path == "kernel" or not bf16)
    g = torch.Generator().manual_seed(seed)
    n = 16
    logits = torch.randn(n, vocab, generator=g) * spread
    if bf16:
        logits = logits.bfloat16().float()
    top_k = top_k if top_k < vocab else 0  # as the runner stages it
    sampled = rows(n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with mock.patch("worker.sampling.cpu_draw", return_value=None) if path == "torch" else contextlib.nullcontext():
        tokens = sample(logits, sampled, path == "sync_free").tolist()
    # A float32 running sum of k terms is off by up to about k * 2^-24 (a flat row, 2,000 kept
    # tokens: 3e-5 seen).
    slack = 1e-5 + vocab * 2**-24
    for i, token in enumerate(tokens):
        lo, hi = reference_interval(logits[i], temperature, top_k, top_p, token)
        u = float(sampled.uniform[i])
        assert lo - slack <= u <= hi + slack, (i, token, lo, u, hi)


def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_does() -> None:
    logits = torch.tensor([[3.0] + [0.0] * 63 + [2.0, 1.0, 2.0, 2.0, -1.0]])  # three tied for 2nd
    assert set(draw(logits, 400, top_k=2)) == {0, 64, 66, 67}
    wide = torch.zeros(1, 300)  # all tied: top-k 64 keeps every one of them
    assert len(set(draw(wide, 2000, top_k=64))) > 200


def test_a_plain_draw_never_takes_a_token_of_probability_zero() -> None:
    """The uniform at the very top of [0, 1), and a row whose tokens past its first candidates
    are masked (-inf) or underflow at a low temperature."""
    n = 300
    g = torch.Generator().manual_seed(1)
    logits = torch.full((n, 3000), float("-inf"))
    logits[:, :40] = torch.randn(n, 40, generator=g)  # float32 sums of these fall short of 1 in some rows
    low = torch.linspace(0, -50, 3000)[None].expand(n, -1)
    for rows_logits, temperature in ((logits, 1.0), (low, 1e-4)):
        sampled = rows(n, temperature=temperature)
        sampled = SampledRows(
            sampled.rows,
            sampled.temperature,
            sampled.top_k,
            sampled.top_p,
            torch.full((n,), 1 - 1e-9, dtype=torch.float64),
            0,
            False,
        )
        tokens = sample(rows_logits.clone(), sampled).tolist()
        probs = torch.softmax(rows_logits.double() / temperature, dim=-1)
        assert all(probs[i, t] > 0 for i, t in enumerate(tokens)), tokens
