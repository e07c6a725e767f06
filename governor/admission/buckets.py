"""Token buckets: the admissions-per-second caps, for the whole pool and for each endpoint, and the
token-cost-per-second cap (where a request takes its cost, not one).

Pure logic, clock passed in (`now`, seconds, monotonic).
"""

from __future__ import annotations

import math


class TokenBucket:
    """`rate` tokens per second, at most `burst` banked; starts full."""

    __slots__ = ("rate", "burst", "tokens", "_stamp", "_booked")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._stamp = now
        self._booked = -math.inf  # when the tokens promised to yielded clients so far are there

    def level(self, now: float) -> float:
        if now > self._stamp:
            self.tokens = min(self.burst, self.tokens + (now - self._stamp) * self.rate)
            self._stamp = now
        return self.tokens

    def wait_s(self, now: float, amount: float = 1.0) -> float:
        """Exactly how long until `amount` tokens are there (0 if they are)."""
        return max(0.0, (amount - self.level(now)) / self.rate)

    def appointment_s(self, now: float, amount: float = 1.0) -> float:
        """How long a refused client should wait: until `amount` tokens nobody else was told to
        come back for are there, so that clients yielded together are spread apart by what each
        needs instead of all returning for the same tokens."""
        at = max(now + self.wait_s(now, amount), self._booked + amount / self.rate)
        self._booked = at
        return at - now

    def take(self, amount: float = 1.0) -> None:
        self.tokens -= amount

    def refund(self, amount: float = 1.0) -> None:
        """Give back `amount` (never above the burst); a negative amount takes more (a debt the
        refill pays off)."""
        self.tokens = min(self.burst, self.tokens + amount)


def make_bucket(qps: float, burst: float, now: float) -> TokenBucket | None:
    """A bucket of `qps` per second holding `burst` (0: one second's worth, at least 1); None for qps 0."""
    return TokenBucket(qps, burst or max(1.0, qps), now) if qps else None


def updated_bucket(bucket: TokenBucket | None, qps: float, burst: float, now: float) -> TokenBucket | None:
    """The bucket for new limits, keeping what the old one holds (never more than the new burst)."""
    fresh = make_bucket(qps, burst, now)
    if fresh is not None and bucket is not None:
        fresh.tokens = min(fresh.burst, bucket.level(now))
    return fresh
