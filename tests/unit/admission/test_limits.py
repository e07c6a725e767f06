"""The request-wide limits: each checks without side effects, charges, refunds and releases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.admission.cost import NO_ASK
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Draining, Grant, InflightLimiter, RateLimit
from govwire.vocab import YieldReason

HINTS = RetryHintEstimator(RetryHintPolicy(jitter=0.0, base_ms=40), capacity=1)


def test_limiter_admits_up_to_the_cap_then_refuses_with_the_estimated_hint() -> None:
    limiter = InflightLimiter(2, HINTS)
    for _ in range(2):
        assert limiter.check(0.0, NO_ASK) is None
        limiter.charge(Grant(), 0.0)
    refusal = limiter.check(0.0, NO_ASK)
    assert refusal is not None and (refusal.reason, refusal.hint_ms) == (YieldReason.INFLIGHT, 40)
    limiter.release(Grant(), executed=True)
    assert limiter.check(0.0, NO_ASK) is None


def test_release_without_charge_fails_loudly() -> None:
    with pytest.raises(RuntimeError):
        InflightLimiter(1, HINTS).release(Grant(), executed=False)
    with pytest.raises(ValueError):
        InflightLimiter(0, HINTS)


@given(st.integers(1, 8), st.lists(st.booleans(), max_size=200))
def test_inflight_never_exceeds_cap_under_any_interleaving(cap: int, ops: list[bool]) -> None:
    limiter = InflightLimiter(cap, HINTS)
    held = 0
    for acquire in ops:
        if acquire:
            if limiter.check(0.0, NO_ASK) is None:
                limiter.charge(Grant(), 0.0)
                held += 1
            else:
                assert held == cap  # refused only when really full
        elif held:
            limiter.release(Grant(), executed=True)
            held -= 1
        assert 0 <= limiter.inflight == held <= cap


def test_draining_refuses_everything_and_holds_nothing() -> None:
    drain = Draining(HINTS)
    assert drain.check(0.0, NO_ASK) is None
    drain.draining = True
    refusal = drain.check(0.0, NO_ASK)
    assert refusal is not None and refusal.reason == YieldReason.DRAINING


def test_the_rate_limit_hint_is_the_exact_wait_for_the_next_unpromised_token() -> None:
    rate = RateLimit(qps=10.0, burst=1.0, now=0.0)
    assert rate.check(0.0, NO_ASK) is None
    rate.charge(Grant(), 0.0)
    hints = []
    for _ in range(2):
        refusal = rate.check(0.02, NO_ASK)
        assert refusal is not None
        hints.append(refusal.hint_ms)  # read at once: the limit refills the same object next time
    assert hints == [80, 180]
    rate.refund(Grant())  # an admitted frame that turned out invalid gives its token back
    assert rate.check(0.02, NO_ASK) is None
    assert RateLimit(qps=0.0, burst=0.0, now=0.0).check(0.0, NO_ASK) is None  # 0 = no cap
