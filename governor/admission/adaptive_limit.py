"""The adaptive concurrency limit: where time to first token starts to grow with concurrency.

Each first token is a sample of (concurrency it was admitted at, its TTFT). The samples are kept
as a latency curve, one decayed mean TTFT per concurrency level, each forgotten after `max_age_s`
without a sample so the curve follows an engine whose speed changes. The curve's floor is the
fastest level seen; the limit is the largest concurrency below which every level's TTFT stays
within `tolerance` times that floor: the knee, where requests start to wait on each other rather
than only share the engine. A load that varies (Poisson arrivals) visits the levels by itself, so
the curve fills in `shadow` mode under a fixed limit. The floor is remembered longer than the
rest of the curve (`floor_age_s`): an engine that slows down raises every level above the old
floor, the limit falls, and the low levels it then visits give the new floor. In `enforce` mode
the limit sits a few
levels above the knee (`headroom`), so the levels just past it keep being measured and the limit
can climb when the engine gets faster.

Netflix's concurrency-limits and Envoy's adaptive concurrency filter compare a sampled latency
with a no-load one (gradient) and move the limit by that ratio; this estimator reads the same
signal as a curve, because a batching engine's TTFT is flat up to its batch and rises after it,
and the knee of that curve is what an operator would tune `--max-inflight` to.

`shadow` exports the recommendation (`governor_adaptive_limit`) and changes nothing; `enforce`
makes it the effective `max_inflight`, within `floor` and `ceiling` (the configured cap).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum


class AdaptiveMode(StrEnum):
    OFF = "off"
    SHADOW = "shadow"
    ENFORCE = "enforce"


@dataclass(frozen=True, slots=True)
class AdaptivePolicy:
    mode: AdaptiveMode = AdaptiveMode.OFF
    floor: int = 1
    ceiling: int = 32
    tolerance: float = 1.5  # a level is past the knee when its TTFT exceeds this times the floor's
    smoothing: float = 0.2  # weight of a new sample in its level's mean
    max_age_s: float = 10.0  # a level without a sample for this long no longer counts
    floor_age_s: float = 60.0  # ... except as the curve's floor, which is remembered this long
    min_samples: int = 3  # samples a level needs before it counts

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError("adaptive limit: 1 <= floor <= ceiling")
        if not (self.tolerance > 1 and 0 < self.smoothing <= 1 and 0 < self.max_age_s <= self.floor_age_s):
            raise ValueError("adaptive limit: tolerance > 1, smoothing in (0, 1], 0 < max_age_s <= floor_age_s")
        if self.min_samples < 1:
            raise ValueError("adaptive limit: min_samples >= 1")


class _Level:
    __slots__ = ("ttft_s", "samples", "seen_at")

    def __init__(self) -> None:
        self.ttft_s = 0.0
        self.samples = 0
        self.seen_at = -math.inf


class AdaptiveLimit:
    __slots__ = ("policy", "limit", "knee", "_levels")

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.policy = policy
        self._levels = [_Level() for _ in range(policy.ceiling + 1)]  # index: concurrency
        self.knee: int | None = None  # None until the curve has a counted level
        self.limit = policy.ceiling  # what it would set (shadow) or sets (enforce)

    @property
    def enforced(self) -> bool:
        return self.policy.mode is AdaptiveMode.ENFORCE

    def set_ceiling(self, ceiling: int) -> None:
        """Live change of the configured cap (SIGHUP); a floor above it comes down to it."""
        policy = self.policy
        floor = min(policy.floor, ceiling)
        self.policy = dataclasses.replace(policy, floor=floor, ceiling=ceiling)
        self._levels.extend(_Level() for _ in range(len(self._levels), ceiling + 1))
        self.limit = max(floor, min(self.limit, ceiling))

    def observe(self, concurrency: int, ttft_s: float, now: float) -> int:
        """A first token of a request admitted at `concurrency`; returns the limit."""
        policy = self.policy
        if not 1 <= concurrency < len(self._levels) or ttft_s < 0:
            return self.limit
        level = self._levels[concurrency]
        if level.samples == 0 or now - level.seen_at > policy.floor_age_s:
            level.ttft_s, level.samples = ttft_s, 1
        else:
            weight = max(policy.smoothing, 1.0 / (level.samples + 1))
            level.ttft_s += weight * (ttft_s - level.ttft_s)
            level.samples += 1
        level.seen_at = now
        self._update(now)
        return self.limit

    def _update(self, now: float) -> None:
        policy = self.policy
        remembered = [
            (c, level.ttft_s, now - level.seen_at)
            for c, level in enumerate(self._levels)
            if level.samples >= policy.min_samples and now - level.seen_at <= policy.floor_age_s
        ]
        counted = [(c, ttft) for c, ttft, age in remembered if age <= policy.max_age_s]
        if not counted:
            return
        # The floor remembers longer than the curve: under a sustained overload the low levels
        # are not visited, and a floor read off the loaded levels alone would let the limit creep.
        bound = policy.tolerance * min(ttft for _, ttft, _ in remembered)
        knee = counted[0][0]
        for c, ttft in counted:
            if ttft > bound:
                break
            knee = c
        self.knee = knee
        headroom = max(1, round(math.sqrt(knee))) if self.enforced else 0
        self.limit = max(policy.floor, min(policy.ceiling, knee + headroom))
