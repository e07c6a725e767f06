"""When each request is submitted: relative, absolute or poisson arrivals.

`relative` sleeps `interval` after each submission, so a slower submit path (client-side
tokenization, hashing, a busy event loop) silently lowers the arrival rate. `absolute` targets
t0 + i * interval whatever the submit path costs, so the arrival rate stays what was asked and
the cost shows up as *submit lag* (actual - target) instead. `poisson` targets cumulative
exponential gaps with mean `interval` (an open-loop arrival process, as vLLM's benchmark does).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class ScheduleKind(enum.StrEnum):
    RELATIVE = "relative"
    ABSOLUTE = "absolute"
    POISSON = "poisson"


@dataclass(frozen=True, slots=True)
class SubmitSchedule:
    kind: ScheduleKind
    interval_s: float  # 0 = everything at once (a burst)

    def __post_init__(self) -> None:
        if self.interval_s < 0:
            raise ValueError("the submit interval must be >= 0")

    def targets(self, count: int, rng: random.Random) -> list[float] | None:
        """Submit times relative to t0 for the absolute and poisson schedules; None for relative,
        whose next submission waits `interval_s` after the previous one was sent."""
        if self.kind is ScheduleKind.RELATIVE:
            return None
        if self.kind is ScheduleKind.ABSOLUTE or self.interval_s == 0:
            return [i * self.interval_s for i in range(count)]
        out: list[float] = []
        t = 0.0
        for _ in range(count):
            out.append(t)
            t += rng.expovariate(1.0 / self.interval_s)
        return out


def submit_lags(targets: list[float], actual: list[float]) -> list[float]:
    """How late each submission was against its target (both relative to t0), in seconds."""
    return [a - t for t, a in zip(targets, actual, strict=True)]
