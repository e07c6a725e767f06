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

    __slots__ = ("policy", "capacity", "service_time_s", "_gap_ms", "_next_ms", "_random", "_jitter_lo", "_jitter_span")

    def __init__(self, policy: RetryHintPolicy, capacity: int, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.capacity = capacity
        self.service_time_s: float | None = None
        self._gap_ms = 0.0  # expected ms between slot releases at saturation; 0 = not known (yet)
        self._next_ms = 0.0  # the latest appointment handed out, on the caller's clock, in ms
        self._random = (rng or random.Random()).random
        self._jitter_lo = 1.0 - policy.jitter
        self._jitter_span = 2.0 * policy.jitter

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        self._update_gap()

    def observe_service_time(self, seconds: float) -> None:
        if seconds < 0:
            return
        if self.service_time_s is None:
            self.service_time_s = seconds
        else:
            self.service_time_s += self.policy.smoothing * (seconds - self.service_time_s)
        self._update_gap()

    def _update_gap(self) -> None:
        # Computed when its inputs change, not per hint: under overload hints outnumber completions.
        if self.policy.adaptive and self.service_time_s is not None and self.capacity > 0:
            self._gap_ms = self.service_time_s * 1000.0 / self.capacity
        else:
            self._gap_ms = 0.0

    def hint_ms(self, now: float) -> int:
        """`now` in seconds, on the same clock as the service times."""
        p = self.policy
        gap = self._gap_ms
        if gap:
            now_ms = now * 1000.0
            appointment = self._next_ms
            if appointment < now_ms:
                appointment = now_ms
            wait_ms = appointment + gap - now_ms
            if wait_ms > p.max_ms:
                wait_ms = p.max_ms
            self._next_ms = now_ms + wait_ms
        else:
            wait_ms = p.base_ms
        wait_ms *= self._jitter_lo + self._jitter_span * self._random()
        if wait_ms < p.min_ms:
            wait_ms = p.min_ms
        elif wait_ms > p.max_ms:
            wait_ms = p.max_ms
        return round(wait_ms) or 1
