"""Token buckets: the admissions-per-second caps, for the whole pool and for each endpoint.

Pure logic, clock passed in (`now`, seconds, monotonic).
"""

from __future__ import annotations


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
        self._booked = now  # the first future token not yet promised to a yielded client

    def level(self, now: float) -> float:
        if now > self._stamp:
            self.tokens = min(self.burst, self.tokens + (now - self._stamp) * self.rate)
            self._stamp = now
        return self.tokens

    def wait_s(self, now: float) -> float:
        """Exactly how long until a token is there (0 if one is)."""
        return max(0.0, (1.0 - self.level(now)) / self.rate)

    def appointment_s(self, now: float) -> float:
        """How long a refused client should wait: until the next token nobody else was told to
        come back for, so that clients yielded together are spread one token apart instead of
        all returning for the same one."""
        at = max(now + self.wait_s(now), self._booked)
        self._booked = at + 1.0 / self.rate
        return at - now

    def take(self) -> None:
        self.tokens -= 1.0

    def refund(self) -> None:
        self.tokens = min(self.burst, self.tokens + 1.0)


def make_bucket(qps: float, burst: float, now: float) -> TokenBucket | None:
    """A bucket of `qps` per second holding `burst` (0: one second's worth, at least 1); None for qps 0."""
    return TokenBucket(qps, burst or max(1.0, qps), now) if qps else None


def updated_bucket(bucket: TokenBucket | None, qps: float, burst: float, now: float) -> TokenBucket | None:
    """The bucket for new limits, keeping what the old one holds (never more than the new burst)."""
    fresh = make_bucket(qps, burst, now)
    if fresh is not None and bucket is not None:
        fresh.tokens = min(fresh.burst, bucket.level(now))
    return fresh
