"""The adaptive concurrency limit: read from the engine's step time against the batch it runs.

Every stream that ends is a sample of its engine: the mean time between its tokens (a decode step
at the batch it ran in) and that batch, the requests in flight while it streamed (the mean of the
count when it was admitted and when it ended). The samples are fitted by a line,

    step(n) = a + b * n

by least squares with exponential forgetting: `a` is what a step costs whatever its batch (reading
the weights, the host's work), `b` what each sequence adds. Two things are read off it:

- **The knee**: the smallest batch at which the engine delivers `throughput` (0.8) of the most it
  can, as the line predicts it: n / (a + b n) tokens per second per step approach 1 / b as the
  batch grows, and reach that share of it at n = throughput / (1 - throughput) x a / b. Below it
  a larger batch is nearly free throughput; past it each request added mostly slows the others
  down. It is the engine's shape, which only samples at several batch sizes show: the line
  is refitted only while the remembered samples spread over several sizes (`MIN_SPREAD`), and
  between such times the last shape is kept. A load that varies (Poisson arrivals, the headroom
  below) spreads them by itself.
- **The speed**: how much slower than that line the latest streams ran (a smoothed ratio of each
  stream's step to the line's at its batch). It moves as soon as the engine slows down (another
  workload on its cores) and needs no spread. The line learns each sample divided by the speed,
  so a slower engine moves the speed, not the shape.

The limit is the knee, brought down while the engine is slower than at its best: the step at the
limit may take at most `slowdown` times the step at the knee at the engine's best speed (the
fastest seen within `floor_age_s`). So when the engine halves, the limit comes down until the
smaller batch's cheaper steps make up for the slower engine, as far as they can; when it recovers,
the limit climbs back to the knee. A slowdown the batch cannot absorb leaves the limit at `floor`
until the best is forgotten: after `floor_age_s` the slower engine is the new normal and the knee
applies again. Reading the engine's step rather than end-to-end TTFT (which a queue inside the
engine, or a long prompt ahead, also moves) lets the limit move down as well as up: the line
predicts the step at every batch, not only at the levels the load happens to visit.

Netflix's concurrency-limits (Gradient2) and Envoy's adaptive concurrency filter compare a sampled
latency with a no-load one and move the limit by that ratio; this estimator keeps the same signal
as a model of a batching engine, whose step cost is linear in its batch, so its limit is where an
operator would set `--max-inflight` by reading the engine's curve.

`shadow` exports the recommendation (`governor_adaptive_limit`) and changes nothing; `enforce`
makes it the effective `max_inflight`, within `floor` and `ceiling` (the configured cap), a few
levels above the knee (`headroom`), so the batch sizes just past it keep being sampled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

FORGETTING = 0.99
"""Each sample's weight in the line decays by this per newer sample: ~100 streams of memory."""
MIN_SPREAD = 1.0
"""The variance of the remembered samples' batch sizes (requests squared) below which the line's
slope is not refitted: at one batch size only the speed can be read."""
MIN_SAMPLES = 16
"""Streams before a first line."""


class AdaptiveMode(StrEnum):
    OFF = "off"
    SHADOW = "shadow"
    ENFORCE = "enforce"


@dataclass(frozen=True, slots=True)
class AdaptivePolicy:
    mode: AdaptiveMode = AdaptiveMode.OFF
    floor: int = 1
    ceiling: int = 32
    throughput: float = 0.8  # the knee: the smallest batch with this share of the engine's most throughput
    slowdown: float = 1.5  # the step at the limit may be this times the step at the knee at the engine's best
    smoothing: float = 0.2  # weight of a new stream in the speed
    floor_age_s: float = 60.0  # how long the engine's best speed is remembered

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError("adaptive limit: 1 <= floor <= ceiling")
        if not (0 < self.throughput < 1 and self.slowdown >= 1 and 0 < self.smoothing <= 1 and self.floor_age_s > 0):
            raise ValueError(
                "adaptive limit: throughput in (0, 1), slowdown >= 1, smoothing in (0, 1], floor_age_s > 0"
            )


class AdaptiveLimit:
    __slots__ = (
        "policy",
        "limit",
        "knee",
        "speed",
        "samples",
        "_sums",
        "_line",
        "_best_s",
        "_best_at",
    )

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.policy = policy
        self.knee: int | None = None  # None until the line is known
        self.limit = policy.ceiling  # what it would set (shadow) or sets (enforce)
        self.speed = 1.0  # the latest streams' step over the line's: > 1 when the engine slowed down
        self.samples = 0
        self._sums = [0.0] * 5  # forgetting sums of 1, n, n^2, step, n * step
        self._line: tuple[float, float] | None = None  # (a, b), seconds: the last well-spread fit
        self._best_s = math.inf  # the step at the knee at the engine's best speed
        self._best_at = -math.inf

    @property
    def enforced(self) -> bool:
        return self.policy.mode is AdaptiveMode.ENFORCE

    def set_ceiling(self, ceiling: int) -> None:
        """Live change of the configured cap (SIGHUP); a floor above it comes down to it."""
        policy = self.policy
        floor = min(policy.floor, ceiling)
        self.policy = dataclasses.replace(policy, floor=floor, ceiling=ceiling)
        self.limit = max(floor, min(self.limit, ceiling))

    def step_at(self, batch: float) -> float | None:
        """The step (seconds) the engine takes now at this batch, as the line and the speed say."""
        line = self._line
        return None if line is None else self.speed * (line[0] + line[1] * batch)

    def observe(self, batch: float, step_s: float, now: float, engine_batch: int = 0) -> int:
        """A stream that ran at about `batch` requests in flight took `step_s` per token; returns
        the limit. `engine_batch`: how many requests the engines behind run at once (0: no bound
        known); the limit stays within it, since the requests past it would queue in the engine."""
        if not (batch >= 1 and step_s > 0 and math.isfinite(batch) and math.isfinite(step_s)):
            return self.limit
        self.samples += 1
        line = self._line
        if line is not None:  # the speed first: the line learns the sample at the engine's usual speed
            a, b = line
            self.speed += self.policy.smoothing * (step_s / (a + b * batch) - self.speed)
            step_s /= self.speed
        sums = self._sums
        for i, value in enumerate((1.0, batch, batch * batch, step_s, batch * step_s)):
            sums[i] = FORGETTING * sums[i] + value
        self._refit()
        if self._line is None:
            return self.limit
        self._update(now, engine_batch)
        return self.limit

    def _refit(self) -> None:
        """Fit the line again when the remembered samples spread over several batch sizes and the
        fit is a step cost that grows with the batch from a positive base (else keep the last)."""
        s0, s1, s2, sy, sny = self._sums
        if self.samples < MIN_SAMPLES:
            return
        mean = s1 / s0
        spread = s2 / s0 - mean * mean
        if spread < MIN_SPREAD:
            return
        slope = (s0 * sny - s1 * sy) / (s0 * s2 - s1 * s1)
        base = (sy - slope * s1) / s0
        if base <= 0 or slope < 0:
            return
        self._line = (base, slope)  # (in the speed's terms: the samples were divided by it)

    def _update(self, now: float, engine_batch: int) -> None:
        policy = self.policy
        line = self._line
        assert line is not None
        a, b = line
        ceiling = min(policy.ceiling, engine_batch) if engine_batch else policy.ceiling
        # n / (a + b n) >= throughput / b  <=>  n >= throughput / (1 - throughput) x a / b
        share = policy.throughput
        knee = ceiling if b <= 0 else min(ceiling, math.ceil(share / (1 - share) * a / b))
        knee = max(policy.floor, knee)
        self.knee = knee
        at_knee = self.speed * (a + b * knee)
        if at_knee <= self._best_s or now - self._best_at > policy.floor_age_s:
            self._best_s, self._best_at = at_knee, now
        budget = policy.slowdown * self._best_s / self.speed  # the most a step may take, in the line's terms
        fits = ceiling if b <= 0 else math.floor((budget - a) / b)
        target = max(policy.floor, min(knee, fits))
        headroom = max(1, round(math.sqrt(target))) if self.enforced else 0
        self.limit = max(policy.floor, min(ceiling, target + headroom))
