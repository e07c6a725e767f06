"""Admission policy: a hard inflight cap and the retry hint handed out with each yield.

Pure logic with the clock passed in (`now`, seconds, monotonic) so tests control time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


class InflightLimiter:
    """Non-blocking counting semaphore: `try_acquire` never waits, `release` never over-frees."""

    __slots__ = ("max_inflight", "inflight")

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.max_inflight = max_inflight
        self.inflight = 0

    def try_acquire(self) -> bool:
        if self.inflight >= self.max_inflight:
            return False
        self.inflight += 1
        return True

    def release(self) -> None:
        if self.inflight <= 0:
            # A double release would silently raise the effective cap; fail loudly instead.
            raise RuntimeError("release() without a matching acquire")
        self.inflight -= 1


@dataclass(frozen=True, slots=True)
class RetryHintPolicy:
    base_ms: float = 50.0
    min_ms: float = 1.0
    max_ms: float = 10_000.0
    adaptive: bool = True
    jitter: float = 0.2
    """Each hint is multiplied by a uniform factor in [1 - jitter, 1 + jitter]."""
    smoothing: float = 0.2
    """EWMA weight of the newest service-time sample."""

    def __post_init__(self) -> None:
        if not 0 < self.min_ms <= self.max_ms:
            raise ValueError("retry hint bounds need 0 < min_ms <= max_ms")
        if not 0 <= self.jitter < 1:
            raise ValueError("retry hint jitter must be in [0, 1)")
        if not 0 < self.smoothing <= 1:
            raise ValueError("retry hint smoothing must be in (0, 1]")


class RetryHintEstimator:
    """When is a slot likely to be free for *this* yielded client?

    At saturation slots free on average every `S / cap` seconds (Little's law), where S is the
    EWMA of observed service times. Each yield books the next free "appointment" on that
    virtual timeline, so a burst of yielded clients is spread over successive expected slot
    releases instead of all being told the same value; the timeline catches up with `now` by
    itself when nobody comes back. Jitter breaks what lockstep is left. Before the first
    completion is observed, and in fixed mode, the hint is the base value with jitter.
    """

    __slots__ = ("policy", "service_time_s", "_next_ms", "_random", "_jitter_lo", "_jitter_span")

    def __init__(self, policy: RetryHintPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.service_time_s: float | None = None
        self._next_ms = 0.0  # the latest appointment handed out, on the caller's clock, in ms
        self._random = (rng or random.Random()).random
        self._jitter_lo = 1.0 - policy.jitter
        self._jitter_span = 2.0 * policy.jitter

    def observe_service_time(self, seconds: float) -> None:
        if seconds < 0:
            return
        if self.service_time_s is None:
            self.service_time_s = seconds
        else:
            self.service_time_s += self.policy.smoothing * (seconds - self.service_time_s)

    def hint_ms(self, now: float, capacity: int) -> int:
        """`now` in seconds on the same clock as the service times; `capacity` >= 1."""
        p = self.policy
        service_time = self.service_time_s
        if service_time is not None and p.adaptive:
            now_ms = now * 1000.0
            appointment = self._next_ms
            if appointment < now_ms:
                appointment = now_ms
            appointment += service_time * 1000.0 / capacity
            if appointment - now_ms > p.max_ms:
                appointment = now_ms + p.max_ms
            self._next_ms = appointment
            wait_ms = appointment - now_ms
        else:
            wait_ms = p.base_ms
        wait_ms *= self._jitter_lo + self._jitter_span * self._random()
        if wait_ms < p.min_ms:
            wait_ms = p.min_ms
        elif wait_ms > p.max_ms:
            wait_ms = p.max_ms
        return round(wait_ms) or 1
