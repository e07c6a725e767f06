"""The adaptive concurrency limit: the knee of the engine's step-time line, its speed, shadow and enforce."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.admission.adaptive_limit import AdaptiveLimit, AdaptiveMode, AdaptivePolicy
from governor.admission.caps import Caps
from governor.admission.cost import NO_ASK
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant

BASE_S, PER_SEQUENCE_S = 0.008, 0.001
"""A batching engine's step: 8 ms whatever the batch, 1 ms more per sequence. Its knee at 80% of
its most throughput (n / (8 + n) >= 0.8): n >= 4 x 8 = 32."""


def engine_step(batch: float, slower: float = 1.0) -> float:
    return slower * (BASE_S + PER_SEQUENCE_S * batch)


def feed(limit: AdaptiveLimit, start: float, seconds: float, top: int, slower: float = 1.0) -> float:
    """Streams ending every 10 ms at batches spread over 1..top (as the limit lets them), each
    step within 3% of the engine's."""
    rng = random.Random(3)
    now = start
    while now < start + seconds:
        batch = rng.uniform(1, max(1, min(top, limit.limit)))
        limit.observe(batch, engine_step(batch, slower) * rng.uniform(0.97, 1.03), now)
        now += 0.01
    return now


def test_shadow_finds_the_knee_and_changes_nothing() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.SHADOW, floor=1, ceiling=64))
    feed(limit, start=0.0, seconds=5.0, top=60)
    assert limit.knee in (31, 32, 33) and limit.limit == limit.knee
    step = limit.step_at(32)
    assert step is not None and step == pytest.approx(engine_step(32), rel=0.05)


def test_the_limit_stays_within_what_the_engine_runs_at_once() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.ENFORCE, floor=1, ceiling=64))
    rng = random.Random(1)
    for i in range(500):
        batch = rng.uniform(1, 60)
        limit.observe(batch, engine_step(batch), i * 0.01, engine_batch=24)
    assert limit.knee == 24 and limit.limit == 24  # no headroom past it: those would queue in the engine


def test_enforce_comes_down_while_the_engine_is_slower_and_back_up_when_it_recovers() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.ENFORCE, floor=2, ceiling=64))
    now = feed(limit, start=0.0, seconds=5.0, top=60)
    knee = limit.knee
    assert knee in (31, 32, 33) and limit.limit == knee + 6
    # The engine halves. The knee (its shape) stays, within a level while the speed catches up; the
    # limit comes down until a step at the limit takes at most 1.5x the step at the knee at its best:
    # 2 x (8 + n) <= 1.5 x (8 + 32) ms, n <= 22 (+ 5 of headroom).
    now = feed(limit, start=now, seconds=3.0, top=60, slower=2.0)
    assert limit.knee is not None and abs(limit.knee - knee) <= 1 and limit.speed == pytest.approx(2.0, rel=0.1)
    assert 25 <= limit.limit <= 29
    now = feed(limit, start=now, seconds=3.0, top=60)  # it recovers: back to the knee within seconds
    assert knee + 4 <= limit.limit <= knee + 8
    # A slowdown that lasts past floor_age_s is the new normal: the knee applies again.
    now = feed(limit, start=now, seconds=61.0, top=60, slower=2.0)
    assert knee + 4 <= limit.limit <= knee + 8 and limit.speed == pytest.approx(2.0, rel=0.05)


def test_a_slowdown_the_batch_cannot_absorb_leaves_the_floor() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.SHADOW, floor=2, ceiling=64))
    now = feed(limit, start=0.0, seconds=5.0, top=60)
    feed(limit, start=now, seconds=3.0, top=60, slower=8.0)  # 8 x 9 ms > 1.5 x 40 ms at any batch
    assert limit.limit == 2


def test_no_line_and_no_knee_until_the_streams_spread_over_several_batch_sizes() -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.ENFORCE, floor=1, ceiling=64))
    for i in range(200):
        limit.observe(8.0, engine_step(8), i * 0.01)  # one batch size: the slope cannot be read
    assert limit.knee is None and limit.limit == 64 and limit.step_at(8) is None
    feed(limit, start=2.0, seconds=3.0, top=60)
    assert limit.knee in (31, 32, 33)


@given(samples=st.lists(st.tuples(st.floats(-5, 80), st.floats(-1, 10)), max_size=200))
def test_the_limit_stays_within_floor_and_ceiling(samples: list[tuple[float, float]]) -> None:
    limit = AdaptiveLimit(AdaptivePolicy(AdaptiveMode.ENFORCE, floor=3, ceiling=40))
    for i, (batch, step) in enumerate(samples):
        assert 3 <= limit.observe(batch, step, i * 0.1) <= 40
        assert limit.knee is None or 3 <= limit.knee <= 40
        assert math.isfinite(limit.speed)


@dataclass
class Stream:
    """What the lifecycle counts of a running request's stream (limits.Progress)."""

    tokens_seen: int
    t_first_token: float | None
    t_last_token: float


def admission(mode: AdaptiveMode) -> Admission:
    endpoint = Endpoint("e", EndpointLimits(), 0.0)
    endpoint.up = True
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0), 32)
    return Admission([endpoint], Caps(max_inflight=64), hints, 0.0, adaptive=AdaptivePolicy(mode, floor=1, ceiling=64))


@pytest.mark.parametrize("mode", [AdaptiveMode.SHADOW, AdaptiveMode.ENFORCE])
def test_only_enforce_moves_the_effective_cap(mode: AdaptiveMode) -> None:
    a = admission(mode)
    rng = random.Random(5)
    now = 0.0
    for _ in range(60):
        grants: list[Grant] = []
        wanted = rng.randint(1, 60)
        while a.inflight.inflight < min(a.inflight.max_inflight, wanted):
            decision = a.decide(now, NO_ASK)
            assert isinstance(decision, Grant)
            grants.append(decision)
        batch = len(grants)
        step = engine_step(batch)
        for grant in grants:
            a.started(grant, step, now)
            grant.progress = Stream(tokens_seen=16, t_first_token=now, t_last_token=now + 15 * step)
        now += 16 * step
        for grant in grants:
            grant.used = 0
            a.release(grant, executed=True, now=now)
    knee = a.adaptive.knee
    assert knee in (31, 32, 33)
    expected = knee + 6 if mode is AdaptiveMode.ENFORCE else 64
    assert a.inflight.max_inflight == expected and a.max_inflight == 64


def test_a_stream_of_fewer_than_three_tokens_teaches_nothing() -> None:
    a = admission(AdaptiveMode.SHADOW)
    grant = a.decide(0.0, NO_ASK)
    assert isinstance(grant, Grant)
    grant.progress = Stream(tokens_seen=2, t_first_token=0.0, t_last_token=0.02)
    a.release(grant, executed=True, now=0.1)
    assert a.adaptive.samples == 0
