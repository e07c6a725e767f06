"""The retry hint of limits that keep no appointments, and of those before anything can be forecast.

The in-flight cap and the token budget hint from the release forecast and book appointments
(release_forecast.py, appointments.py); the other concurrency limits (tenant caps and shares,
fleet shares, the endpoint pool) estimate from the observed service time here.

Pure logic with the clock passed in (`now`, seconds, monotonic) so tests control time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryHintPolicy:
    base_ms: float = 50.0
    min_ms: float = 1.0
    max_ms: float = 10_000.0
    horizon_ms: float = 1000.0
    """The promise horizon: a client whose capacity the forecast puts further away than this is
    refused for good (`Refusal.final`) rather than told to come back: a promise is booked only
    where it can be kept soon, so a caller either gets in within about this long or learns at
    once that it will not. Short for interactive callers, past its drain time for a batch job."""
    adaptive: bool = True
    jitter: float = 0.2
    """Each hint is multiplied by a uniform factor in [1, 1 + jitter]: one-sided, so that no client
    is told to come back before the time computed for it."""
    smoothing: float = 0.2
    """EWMA weight of the newest service-time sample."""

    def __post_init__(self) -> None:
        if not 0 < self.min_ms <= self.max_ms:
            raise ValueError("retry hint bounds need 0 < min_ms <= max_ms")
        if not self.horizon_ms > 0:
            raise ValueError("the promise horizon must be > 0 ms")
        if self.max_ms < self.horizon_ms:  # a promise inside the horizon is never clamped shorter
            object.__setattr__(self, "max_ms", self.horizon_ms)
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
    itself when nobody comes back. Jitter (one-sided: never earlier) breaks what lockstep is left. Before the first
    completion is observed, and in fixed mode, the hint is the base value with jitter.
    """

    __slots__ = (
        "policy",
        "capacity",
        "service_time_s",
        "_gap_ms",
        "_next_ms",
        "_random",
        "_jitter_lo",
        "_jitter_span",
        "_base_ms",
        "_min_ms",
        "_max_ms",
    )

    def __init__(self, policy: RetryHintPolicy, capacity: int, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.capacity = capacity
        self.service_time_s: float | None = None
        self._gap_ms = 0.0  # expected ms between slot releases at saturation; 0 = not known (yet)
        self._next_ms = 0.0  # the latest appointment handed out, on the caller's clock, in ms
        self._random = (rng or random.Random()).random
        # The policy's numbers, copied where `hint_ms` (run for every refused frame) reads them.
        self._jitter_lo = 1.0
        self._jitter_span = policy.jitter
        self._base_ms = policy.base_ms
        self._min_ms = policy.min_ms
        self._max_ms = policy.max_ms

    @property
    def gap_s(self) -> float:
        """The mean time between two releases at saturation, seconds (0 = not known)."""
        return self._gap_ms / 1000.0

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

    def hint_ms(self, now: float, slots: float = 1) -> int:
        """`now` in seconds, on the same clock as the service times; `slots`: how many releases the
        refused client needs (more than one under a priority class ceiling; scaled from the
        capacity to a fleet share by fleet/lease.py)."""
        gap = self._gap_ms
        if gap:
            now_ms = now * 1000.0
            appointment = self._next_ms
            if appointment < now_ms:
                appointment = now_ms
            wait_ms = appointment + gap * slots - now_ms
            if wait_ms > self._max_ms:
                wait_ms = self._max_ms
            self._next_ms = now_ms + wait_ms
        else:
            wait_ms = self._base_ms
        # `jittered_ms` inlined: this runs for every frame refused by a concurrency limit
        wait_ms *= self._jitter_lo + self._jitter_span * self._random()
        if wait_ms < self._min_ms:
            wait_ms = self._min_ms
        elif wait_ms > self._max_ms:
            wait_ms = self._max_ms
        return math.ceil(wait_ms - 1e-6) or 1  # rounded up: never sooner than computed

    def jittered_ms(self, wait_ms: float) -> int:
        """A computed wait as a hint: jittered and clamped like the others."""
        wait_ms *= self._jitter_lo + self._jitter_span * self._random()
        if wait_ms < self._min_ms:
            wait_ms = self._min_ms
        elif wait_ms > self._max_ms:
            wait_ms = self._max_ms
        return math.ceil(wait_ms - 1e-6) or 1  # rounded up: never sooner than computed


class DrainHint:
    """The retry hint of a budget that running requests hold and give back when they end (the
    in-flight tokens, globally or per endpoint).

    By Little's law the `held` amount drains at `held / S` per second, S being the observed service
    time. A refused request needs the budget's `deficit` to drain; each refusal books its amount on
    a virtual timeline, so requests refused together are told successive times instead of the same
    one. Before any service time is known, the base hint."""

    __slots__ = ("_hints", "_booked")

    def __init__(self, hints: RetryHintEstimator) -> None:
        self._hints = hints
        self._booked = -math.inf  # seconds, on the caller's clock: when the drain promised so far is done

    def hint_ms(self, now: float, deficit: float, amount: float, held: float) -> int:
        hints = self._hints
        service_s = hints.service_time_s
        if not service_s or service_s <= 0 or held <= 0 or not hints.policy.adaptive:
            return hints.jittered_ms(hints.policy.base_ms)
        # Branches rather than max/min: this runs for every frame a held budget refuses.
        per_s = service_s / held
        at = now + deficit * per_s
        booked = self._booked + amount * per_s
        if booked > at:
            at = booked
        wait_ms = (at - now) * 1000.0
        max_ms = hints.policy.max_ms
        if wait_ms > max_ms:
            wait_ms = max_ms
        self._booked = now + wait_ms / 1000.0
        return hints.jittered_ms(wait_ms)
