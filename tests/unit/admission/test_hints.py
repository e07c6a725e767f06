"""The retry hint: spread over expected slot releases, clamped, jittered."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.admission.hints import RetryHintEstimator, RetryHintPolicy


def no_jitter(**kw: float | bool) -> RetryHintPolicy:
    return RetryHintPolicy(jitter=0.0, **kw)  # type: ignore[arg-type]


def test_hint_is_base_value_before_any_observation() -> None:
    hints = RetryHintEstimator(no_jitter(base_ms=40), capacity=4)
    assert hints.hint_ms(now=0.0) == 40


def test_burst_of_yields_is_spread_over_expected_slot_releases() -> None:
    hints = RetryHintEstimator(no_jitter(), capacity=4)
    hints.observe_service_time(0.4)  # 4 slots, 400 ms each -> one frees every 100 ms
    got = [hints.hint_ms(now=10.0) for _ in range(4)]
    assert got == [100, 200, 300, 400]
    # Appointments not taken up expire with time: later, the queue of promises is gone.
    assert hints.hint_ms(now=20.0) == 100
    hints.set_capacity(8)  # twice the slots: they free twice as often
    assert hints.hint_ms(now=30.0) == 50


def test_hint_is_clamped_and_never_zero() -> None:
    # max_ms below the promise horizon is raised to it: the horizon is set below it here
    assert no_jitter(max_ms=250).max_ms == 1000.0
    hints = RetryHintEstimator(no_jitter(min_ms=5, max_ms=250, horizon_ms=200), capacity=100)
    hints.observe_service_time(0.0001)
    assert hints.hint_ms(now=0.0) == 5
    hints.set_capacity(1)
    hints.observe_service_time(1000.0)
    assert all(hints.hint_ms(now=0.0) == 250 for _ in range(3))


def test_fixed_mode_ignores_observations() -> None:
    hints = RetryHintEstimator(no_jitter(adaptive=False, base_ms=70), capacity=1)
    hints.observe_service_time(5.0)
    assert hints.hint_ms(now=0.0) == 70


def test_service_time_is_an_ewma() -> None:
    hints = RetryHintEstimator(RetryHintPolicy(smoothing=0.5), capacity=1)
    hints.observe_service_time(1.0)
    hints.observe_service_time(3.0)
    assert hints.service_time_s == pytest.approx(2.0)


def test_jitter_spreads_identical_hints() -> None:
    hints = RetryHintEstimator(RetryHintPolicy(base_ms=100, jitter=0.2), capacity=1, rng=random.Random(1))
    values = {hints.hint_ms(now=0.0) for _ in range(50)}
    assert len(values) > 10
    assert all(80 <= v <= 120 for v in values)


@given(
    st.lists(st.floats(0, 100), max_size=20),
    st.lists(st.tuples(st.floats(0, 1e4), st.integers(1, 512)), min_size=1, max_size=50),
)
def test_hint_is_always_a_positive_int_within_bounds(samples: list[float], calls: list[tuple[float, int]]) -> None:
    policy = RetryHintPolicy(min_ms=2, max_ms=3000)
    hints = RetryHintEstimator(policy, capacity=1, rng=random.Random(0))
    for s in samples:
        hints.observe_service_time(s)
    for now, capacity in sorted(calls):
        hints.set_capacity(capacity)
        hint = hints.hint_ms(now=now)
        assert isinstance(hint, int) and 2 <= hint <= 3000


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RetryHintPolicy(min_ms=10, max_ms=5)
    with pytest.raises(ValueError):
        RetryHintPolicy(jitter=1.0)
