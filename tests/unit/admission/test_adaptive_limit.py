"""The adaptive concurrency limit: the knee of the TTFT-over-concurrency curve, shadow and enforce."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.admission.adaptive_limit import AdaptiveLimit, AdaptiveMode, AdaptivePolicy
from governor.admission.cost import NO_ASK
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant


def engine_ttft(concurrency: int, batch: int, step_s: float) -> float:
    """A batching engine: flat up to its batch, then requests wait for whole turns."""
    return step_s * (1 + max(0, concurrency - batch))


def feed(limit: AdaptiveLimit, batch: int, step_s: float, start: float, seconds: float, top: int) -> float:
    rng = random.Random(3)
    now = start
    while now < start + seconds:
        c = rng.randint(1, top)
        limit.observe(c, engine_ttft(c, batch, step_s) * rng.uniform(0.95, 1.05), now)
        now += 0.01
    return now


def test_shadow_finds_the_knee_and_changes_nothing() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.SHADOW, floor=1, ceiling=64))
    feed(limit, batch=12, step_s=0.05, start=0.0, seconds=5.0, top=30)
    assert limit.knee == 12 and limit.limit == 12  # tolerance 1.5: one extra turn is past it


def test_enforce_keeps_headroom_above_the_knee_and_follows_a_slower_engine() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.ENFORCE, floor=2, ceiling=64))
    now = feed(limit, batch=16, step_s=0.05, start=0.0, seconds=5.0, top=30)
    assert limit.knee == 16 and limit.limit == 16 + 4
    # The engine halves: each step takes twice as long. The old floor is remembered, so every
    # level now looks slow; the levels visited next set a new floor, and the knee is found again.
    now = feed(limit, batch=8, step_s=0.1, start=now, seconds=70.0, top=30)
    assert limit.knee == 8 and limit.limit == 8 + 3


@given(samples=st.lists(st.tuples(st.integers(-5, 80), st.floats(0, 10)), max_size=200))
def test_the_limit_stays_within_floor_and_ceiling(samples: list[tuple[int, float]]) -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.ENFORCE, floor=3, ceiling=40))
    for i, (c, ttft) in enumerate(samples):
        assert 3 <= limit.observe(c, ttft, i * 0.1) <= 40


def admission(mode: AdaptiveMode) -> Admission:
    endpoint = Endpoint("e", EndpointLimits(), 0.0)
    endpoint.up = True
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0), 32)
    return Admission([endpoint], 32, 0.0, 0.0, hints, 0.0, adaptive=AdaptivePolicy(mode, floor=1, ceiling=32))


@pytest.mark.parametrize("mode", [AdaptiveMode.SHADOW, AdaptiveMode.ENFORCE])
def test_only_enforce_moves_the_effective_cap(mode: AdaptiveMode) -> None:
    a = admission(mode)
    grants: list[Grant] = []
    now = 0.0
    for round_ in range(40):
        while a.inflight.inflight < min(a.inflight.max_inflight, 20):
            decision = a.decide(now, NO_ASK)
            assert isinstance(decision, Grant)
            grants.append(decision)
        for grant in grants:
            a.started(grant, engine_ttft(grant.concurrency, 4, 0.05), now)
            grant.used = 0
            a.release(grant, executed=True)
        grants.clear()
        now += 0.1 * (round_ + 1)
    assert a.adaptive.knee == 4
    expected = 4 + 2 if mode is AdaptiveMode.ENFORCE else 32
    assert a.inflight.max_inflight == expected and a.max_inflight == 32
