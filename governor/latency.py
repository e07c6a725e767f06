"""The governor's latency histograms: lock-free, observed on the hot paths, read at scrape time."""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Sequence

# Decision latency is microseconds; request latencies span ms (echo) to minutes (long generations).
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The event loop's lag: how late a timer runs, from a fraction of a millisecond to a stalled second.
LAG_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
# The hints handed out with yields: from a millisecond to the 10-s default clamp and beyond.
HINT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LAG_SAMPLE_S = 0.05
"""How often the loop's lag is sampled (`sample_loop_lag`)."""


class Histogram:
    """Lock-free cumulative-bucket histogram for single-threaded (event loop) use."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf only)
        self.total = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float, times: int = 1) -> None:
        """`times` samples of `value` (a read's frames share one decision-latency sample)."""
        # bisect_left: a value equal to a bound belongs to that bound's `le` bucket.
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class LatencyMetrics:
    __slots__ = (
        "admission_decision",
        "queue_wait",
        "time_to_first_token",
        "request_duration",
        "event_loop_lag",
        "retry_hints",
    )

    def __init__(self) -> None:
        self.admission_decision = Histogram(DECISION_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.time_to_first_token = Histogram(LATENCY_BUCKETS)
        self.request_duration = Histogram(LATENCY_BUCKETS)
        self.event_loop_lag = Histogram(LAG_BUCKETS)
        self.retry_hints: dict[str, Histogram] = {}  # by yield reason, as they are first handed out

    def retry_hint(self, reason: str, hint_ms: int) -> None:
        """A yield went out with this hint."""
        histogram = self.retry_hints.get(reason)
        if histogram is None:
            histogram = self.retry_hints[reason] = Histogram(HINT_BUCKETS)
        histogram.observe(hint_ms / 1000)


async def sample_loop_lag(lag: Histogram, clock: Callable[[], float], interval_s: float = LAG_SAMPLE_S) -> None:
    """Sleep `interval_s` again and again and record how much later than asked each sleep ended:
    the time a ready callback (a read, a token, a timer) waits behind the work of the turn before
    it. What a client's admitted frame waits beyond its own cost shows here first."""
    while True:
        asked = clock() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, clock() - asked))
