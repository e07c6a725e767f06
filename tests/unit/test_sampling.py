"""Sampling a step at once: greedy rows, filters, seeded draws."""

from __future__ import annotations

import random

import torch

from worker.sampling import SampledRows, sample


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
