"""Two-layer caps: the pool's hard limits over each endpoint's soft ones, on a simulated clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.admission import InflightLimiter
from governor.pool import (
    YIELD_ENDPOINT_INFLIGHT,
    YIELD_ENDPOINT_QPS,
    YIELD_QPS,
    Endpoint,
    EndpointLimits,
    Pool,
    Refusal,
    TokenBucket,
)


def pool(*limits: EndpointLimits, qps: float = 0.0, burst: float = 0.0, capacity: int = 100) -> Pool:
    endpoints = [Endpoint(f"e{i}", lim, now=0.0) for i, lim in enumerate(limits)]
    for e in endpoints:
        e.up = True
    return Pool(endpoints, qps, burst, capacity, now=0.0)


def test_the_bucket_refills_at_its_rate_and_says_exactly_when_the_next_token_comes() -> None:
    b = TokenBucket(rate=10.0, burst=2.0, now=0.0)
    b.take()
    b.take()
    assert b.wait_s(0.0) == pytest.approx(0.1)
    assert b.wait_s(0.05) == pytest.approx(0.05)
    assert b.level(1.0) == 2.0  # never above the burst


def test_load_follows_the_endpoint_caps_and_weights() -> None:
    p = pool(EndpointLimits(concurrency=1), EndpointLimits(concurrency=3), EndpointLimits(weight=2.0), capacity=2)
    # relative load = inflight / (cap * weight); an uncapped endpoint counts the default capacity (2)
    picks = [p.reserve(0.0) for _ in range(8)]
    assert [e.name for e in picks if isinstance(e, Endpoint)] == ["e0", "e1", "e2", "e2", "e1", "e2", "e1", "e2"]
    assert [e.inflight for e in p.endpoints] == [1, 3, 4]  # each at its share: 1/1, 3/3, 4/(2*2)
    assert p.reserve(0.0) is p.endpoints[2]  # the capped ones are full; the uncapped one takes the rest


def test_equal_endpoints_take_turns() -> None:
    p = pool(EndpointLimits(), EndpointLimits(), EndpointLimits())
    names = []
    for _ in range(6):
        e = p.reserve(0.0)
        assert isinstance(e, Endpoint)
        names.append(e.name)
        p.release(e, executed=True)
    assert names == ["e0", "e1", "e2", "e0", "e1", "e2"]


def test_each_limit_names_itself_and_a_refusal_charges_nothing() -> None:
    p = pool(EndpointLimits(concurrency=1), EndpointLimits(qps=1.0), qps=100.0, burst=3.0)
    assert isinstance(p.reserve(0.0), Endpoint) and isinstance(p.reserve(0.0), Endpoint)
    assert p.reserve(0.0) == Refusal(YIELD_ENDPOINT_QPS, pytest.approx(1.0))  # e0 full, e1 out of tokens
    assert p.bucket is not None and p.bucket.level(0.0) == 1.0  # the refused request took no pool token
    p.endpoints[1].bucket = None
    p.endpoints[1].limits = EndpointLimits(concurrency=1)
    assert p.reserve(0.0) == Refusal(YIELD_ENDPOINT_INFLIGHT, None)
    p.release(p.endpoints[0], executed=True)
    assert isinstance(p.reserve(0.0), Endpoint)  # the pool's last token
    p.release(p.endpoints[0], executed=True)
    refusal = p.reserve(0.0)
    assert refusal == Refusal(YIELD_QPS, pytest.approx(0.01))
    assert p.endpoints[0].inflight == 0


def test_a_down_endpoint_takes_nothing_and_none_up_is_none() -> None:
    p = pool(EndpointLimits(), EndpointLimits())
    p.endpoints[0].up = False
    assert all(p.reserve(0.0) is p.endpoints[1] for _ in range(3))
    p.endpoints[1].up = False
    assert p.reserve(0.0) is None


def test_refund_returns_the_tokens_of_an_unused_reservation() -> None:
    p = pool(EndpointLimits(qps=5.0, burst=1.0), qps=5.0, burst=1.0)
    e = p.reserve(0.0)
    assert isinstance(e, Endpoint)
    p.refund(e)
    p.release(e, executed=False)
    assert isinstance(p.reserve(0.0), Endpoint)  # both buckets had their token back


ENDPOINTS = st.lists(
    st.builds(
        EndpointLimits,
        concurrency=st.integers(0, 4),
        qps=st.sampled_from([0.0, 2.0, 5.0, 50.0]),
        burst=st.sampled_from([0.0, 1.0, 3.0]),
        weight=st.sampled_from([1.0, 2.0]),
    ),
    min_size=1,
    max_size=4,
)
EVENTS = st.lists(
    st.tuples(st.sampled_from(["arrive", "arrive", "arrive", "finish", "tick", "flip"]), st.integers(0, 10**6)),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ENDPOINTS, st.integers(1, 6), st.sampled_from([0.0, 3.0, 20.0]), st.sampled_from([0.0, 1.0, 4.0]), EVENTS)
def test_no_limit_is_ever_exceeded_and_refusals_leave_no_trace(
    limits: list[EndpointLimits], max_inflight: int, qps: float, burst: float, events: list[tuple[str, int]]
) -> None:
    p = pool(*limits, qps=qps, burst=burst, capacity=max_inflight)
    limiter = InflightLimiter(max_inflight)
    now = 0.0
    running: list[Endpoint] = []
    admitted: list[tuple[float, Endpoint]] = []
    for kind, n in events:
        if kind == "tick":
            now += (n % 1000) / 2000  # up to 0.5 s
        elif kind == "flip":
            e = p.endpoints[n % len(p.endpoints)]
            e.up = not e.up
        elif kind == "finish" and running:
            e = running.pop(n % len(running))
            p.release(e, executed=True)
            limiter.release()
        elif kind == "arrive" and limiter.try_acquire():
            levels = [b.level(now) if b else None for b in [p.bucket, *(e.bucket for e in p.endpoints)]]
            counts = [e.inflight for e in p.endpoints]
            got = p.reserve(now)
            if isinstance(got, Endpoint):
                running.append(got)
                admitted.append((now, got))
            else:
                limiter.release()
                after = [b.level(now) if b else None for b in [p.bucket, *(e.bucket for e in p.endpoints)]]
                assert after == levels and [e.inflight for e in p.endpoints] == counts
        assert limiter.inflight <= max_inflight and limiter.inflight == len(running)
        for e in p.endpoints:
            assert not e.limits.concurrency or e.inflight <= e.limits.concurrency
    # admissions in any window [t_i, t_j] never exceed rate * (t_j - t_i) + burst
    windows: list[tuple[float, float, list[float]]] = [
        (qps, burst or max(1.0, qps), [t for t, _ in admitted]) if qps else (0.0, 0.0, [])
    ]
    for e in p.endpoints:
        if e.limits.qps:
            times = [t for t, x in admitted if x is e]
            windows.append((e.limits.qps, e.limits.burst or max(1.0, e.limits.qps), times))
    for rate, allowance, times in windows:
        for i in range(len(times)):
            for j in range(i, len(times)):
                assert j - i + 1 <= rate * (times[j] - times[i]) + allowance + 1e-9


def test_clients_refused_together_are_told_successive_tokens() -> None:
    p = pool(EndpointLimits(), qps=10.0, burst=1.0)
    assert isinstance(p.reserve(0.0), Endpoint)
    waits = [r.wait_s for r in (p.reserve(0.02), p.reserve(0.02), p.reserve(0.02)) if isinstance(r, Refusal)]
    assert waits == pytest.approx([0.08, 0.18, 0.28])  # the next token, and the two after it
    assert isinstance(p.reserve(0.1), Endpoint)  # the first one, back on time, gets its token


@pytest.mark.parametrize(
    "bad", [{"burst": 0.5}, {"qps": math.nan}, {"weight": math.inf}, {"weight": 0.0}, {"concurrency": -1}]
)
def test_limits_that_cannot_work_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="endpoint limits"):
        EndpointLimits(**bad)  # type: ignore[arg-type]


def test_a_reroute_takes_an_endpoint_slot_but_not_a_second_global_token() -> None:
    p = pool(EndpointLimits(), qps=1.0, burst=1.0)
    assert isinstance(p.reserve(0.0), Endpoint)
    assert isinstance(p.reserve(0.0), Refusal)  # the global token is spent
    assert p.reserve(0.0, charge_global=False) is p.endpoints[0]
