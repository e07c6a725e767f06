"""Per-request sampling: greedy, filters, seeds."""

from __future__ import annotations

import torch

from worker.sampling import make_generator, sample
from worker.sequence import SamplingParams

CPU = torch.device("cpu")


def draw(logits: torch.Tensor, params: SamplingParams, n: int = 200) -> list[int]:
    generator = make_generator(params, CPU)
    return [sample(logits[None], [params], [generator])[0] for _ in range(n)]


def test_greedy_rows_take_the_argmax_and_sampled_rows_their_own_generator() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy, greedy], [None, None]) == [1, 0]


def test_top_k_and_top_p_never_sample_outside_their_set() -> None:
    logits = torch.tensor([2.0, 1.9, 1.8, 0.0, -1.0, -2.0])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2, seed=1))) == {0, 1}
    # The first token holds 0.34 of the mass, the first two 0.65: top_p 0.5 keeps tokens 0 and 1.
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=1))) == {0, 1}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=1))) == {0}
    assert len(set(draw(logits, SamplingParams(temperature=5.0, seed=1)))) == 6


def test_a_seed_reproduces_the_draws_and_another_seed_differs() -> None:
    logits = torch.zeros(50)
    a = draw(logits, SamplingParams(seed=123), 30)
    assert a == draw(logits, SamplingParams(seed=123), 30)
    assert a != draw(logits, SamplingParams(seed=124), 30)


def test_a_vanishing_temperature_samples_the_argmax_instead_of_failing() -> None:
    # Dividing raw logits by 1e-300 overflows to inf; inf - inf is NaN, which multinomial refuses.
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1e-300, seed=3)
    assert sample(logits, [params], [make_generator(params, CPU)]) == [1]
