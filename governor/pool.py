"""The endpoint pool's admission: global hard caps over per-endpoint soft caps, and the routing.

Pure logic, clock passed in (`now`, seconds, monotonic). Four limits decide whether a request may
go and where: the pool's concurrency (`InflightLimiter`, checked by the caller first), the pool's
token bucket (`--max-qps`), and each endpoint's concurrency and token bucket. `Pool.reserve`
checks every limit before it charges any, so a refused request leaves no trace on any of them;
single-threaded asyncio makes check-then-charge atomic. A request that is refused after all
(invalid once admitted) gives its tokens back with `refund`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

YIELD_QPS = "qps"
YIELD_ENDPOINT_INFLIGHT = "endpoint_inflight"
YIELD_ENDPOINT_QPS = "endpoint_qps"


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


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    """Soft caps of one endpoint; 0 means none."""

    concurrency: int = 0
    qps: float = 0.0
    burst: float = 0.0  # 0 = max(1, qps): one second's worth
    weight: float = 1.0

    def __post_init__(self) -> None:
        numbers = (self.qps, self.burst, self.weight)
        if self.concurrency < 0 or not all(math.isfinite(x) and x >= 0 for x in numbers) or self.weight == 0:
            raise ValueError("endpoint limits: concurrency, qps and burst must be finite and >= 0, weight > 0")
        if 0 < self.burst < 1:
            raise ValueError("endpoint limits: burst must be >= 1 (or 0 for the default)")

    def bucket(self, now: float) -> TokenBucket | None:
        return make_bucket(self.qps, self.burst, now)


def make_bucket(qps: float, burst: float, now: float) -> TokenBucket | None:
    return TokenBucket(qps, burst or max(1.0, qps), now) if qps else None


def updated_bucket(bucket: TokenBucket | None, qps: float, burst: float, now: float) -> TokenBucket | None:
    """The bucket for new limits, keeping what the old one holds (never more than the new burst)."""
    fresh = make_bucket(qps, burst, now)
    if fresh is not None and bucket is not None:
        fresh.tokens = min(fresh.burst, bucket.level(now))
    return fresh


class Endpoint:
    __slots__ = ("name", "limits", "bucket", "inflight", "up", "executed", "failed")

    def __init__(self, name: str, limits: EndpointLimits, now: float) -> None:
        self.name = name
        self.limits = limits
        self.bucket = limits.bucket(now)
        self.inflight = 0
        self.up = False  # set by its link: a down endpoint's capacity does not count
        self.executed = 0
        self.failed = 0  # every admitted request that did not end in `done`

    def set_limits(self, limits: EndpointLimits, now: float) -> None:
        """Live change: a lower cap stops new admissions until in-flight falls under it."""
        self.limits = limits
        self.bucket = updated_bucket(self.bucket, limits.qps, limits.burst, now)


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    wait_s: float | None  # exact for the token buckets; None: estimate it from service times


class Pool:
    def __init__(self, endpoints: list[Endpoint], qps: float, burst: float, default_capacity: int, now: float) -> None:
        self.endpoints = endpoints
        self.bucket = make_bucket(qps, burst, now)
        self.default_capacity = default_capacity  # what "relative to capacity" uses for uncapped endpoints
        self._next = 0  # round-robin start among equally loaded endpoints

    def reserve(self, now: float, *, charge_global: bool = True) -> Endpoint | Refusal | None:
        """Charge the pool's bucket and the chosen endpoint's slot and bucket, or nothing at all.
        None when no endpoint is up (the caller reports the worker as unavailable). A re-routed
        request was already counted by the global bucket: `charge_global=False`."""
        endpoints = self.endpoints
        if not any(e.up for e in endpoints):
            return None
        bucket = self.bucket if charge_global else None
        if bucket is not None and bucket.level(now) < 1.0:
            return Refusal(YIELD_QPS, bucket.appointment_s(now))
        best: Endpoint | None = None
        best_index = 0
        best_load = math.inf
        qps_bucket: TokenBucket | None = None  # the endpoint bucket that refills first
        n = len(endpoints)
        for k in range(n):
            index = (self._next + k) % n
            e = endpoints[index]
            cap = e.limits.concurrency
            if not e.up or (cap and e.inflight >= cap):
                continue
            if e.bucket is not None and e.bucket.level(now) < 1.0:
                if qps_bucket is None or e.bucket.wait_s(now) < qps_bucket.wait_s(now):
                    qps_bucket = e.bucket
                continue
            load = e.inflight / ((cap or self.default_capacity) * e.limits.weight)
            if load < best_load:
                best, best_index, best_load = e, index, load
        if best is None:
            if qps_bucket is not None:
                return Refusal(YIELD_ENDPOINT_QPS, qps_bucket.appointment_s(now))
            return Refusal(YIELD_ENDPOINT_INFLIGHT, None)
        if bucket is not None:
            bucket.take()
        if best.bucket is not None:
            best.bucket.take()
        best.inflight += 1
        self._next = (best_index + 1) % n
        return best

    def set_global(self, qps: float, burst: float, default_capacity: int, now: float) -> None:
        self.bucket = updated_bucket(self.bucket, qps, burst, now)
        self.default_capacity = default_capacity

    def refund(self, endpoint: Endpoint, *, charge_global: bool = True) -> None:
        """Give back the tokens of a reservation that was not used (its slot goes with `release`);
        `charge_global` as it was passed to `reserve`."""
        if charge_global and self.bucket is not None:
            self.bucket.refund()
        if endpoint.bucket is not None:
            endpoint.bucket.refund()

    def release(self, endpoint: Endpoint, executed: bool) -> None:
        if endpoint.inflight <= 0:
            raise RuntimeError("release() without a matching reserve")
        endpoint.inflight -= 1
        if executed:
            endpoint.executed += 1
        else:
            endpoint.failed += 1
