"""Prometheus exposition of the governor's own counters.

The hot path only bumps plain ints (see accounting.py) and `Histogram.observe` (a bisect and two
adds); prometheus-client's own Counter/Histogram take a lock per call, which the yield path cannot
afford. A custom collector turns the plain values into metric families at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from governor.state import ServerState
    from governor.upstream import WorkerLink

# Decision latency is microseconds; request latencies span ms (echo) to minutes (long generations).
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


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

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's `le` bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class LatencyMetrics:
    __slots__ = ("admission_decision", "queue_wait", "time_to_first_token", "request_duration")

    def __init__(self) -> None:
        self.admission_decision = Histogram(DECISION_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.time_to_first_token = Histogram(LATENCY_BUCKETS)
        self.request_duration = Histogram(LATENCY_BUCKETS)


_HISTOGRAM_HELP = {
    "admission_decision": "Time from the read that completed a generate frame to its admit or yield decision.",
    "queue_wait": "Time an admitted request waited inside the worker before its prefill started.",
    "time_to_first_token": "Time from an admitted frame to its first token, measured at the governor.",
    "request_duration": "Time from frame arrival to the final reply, for requests dispatched to a worker.",
}


# The worker's pushed statistics (worker/engines/gpt2.py `stats`) exported per endpoint. Keys
# ending in `_total` are counters (they restart at 0 when a worker restarts); the rest are gauges.
WORKER_STATS_HELP = {
    "steps_total": "Engine steps (one batched forward each).",
    "step_sequences_total": "Sequences summed over steps; / steps = mean batch size.",
    "prefill_tokens_total": "Prompt tokens run through the model.",
    "generated_tokens_total": "Tokens generated (streamed to clients).",
    "finished_total": "Requests the engine finished (any finish reason).",
    "busy_seconds_total": "Seconds spent in engine steps; its rate is the engine's utilisation.",
    "running": "Sequences in the running batch (prefilling or decoding).",
    "waiting": "Requests queued inside the worker, waiting for a batch slot or KV cache room.",
    "kv_cache_used_tokens": "KV cache rows reserved by running sequences.",
    "kv_cache_capacity_tokens": "KV cache size in tokens (--kv-cache-tokens).",
    "kv_cache_bytes": "Bytes of the preallocated KV cache.",
}


def _worker_stats_families(links: Sequence[WorkerLink]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    for key, help_text in WORKER_STATS_HELP.items():
        samples = [(link.address, link.engine_stats[key]) for link in links if key in link.engine_stats]
        if not samples:
            continue
        family: GaugeMetricFamily | CounterMetricFamily
        if key.endswith("_total"):
            family = CounterMetricFamily(f"governor_worker_{key[:-6]}", help_text, labels=["endpoint"])
        else:
            family = GaugeMetricFamily(f"governor_worker_{key}", help_text, labels=["endpoint"])
        for address, value in samples:
            family.add_metric([address], value)
        yield family


def _endpoint_families(s: ServerState) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The pool's soft layer, one sample per endpoint (its worker address)."""
    now = s.clock()
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "up": GaugeMetricFamily("governor_endpoint_up", "1 while the endpoint answers pings.", labels=["endpoint"]),
        "inflight": GaugeMetricFamily(
            "governor_endpoint_inflight", "Admitted requests without a final reply.", labels=["endpoint"]
        ),
        "executed": CounterMetricFamily(
            "governor_endpoint_executed", "Requests the endpoint completed with done.", labels=["endpoint"]
        ),
        "failed": CounterMetricFamily(
            "governor_endpoint_failed", "Admitted requests that did not end in done.", labels=["endpoint"]
        ),
        "concurrency": GaugeMetricFamily(
            "governor_endpoint_concurrency_limit", "The endpoint's concurrency cap; 0 = none.", labels=["endpoint"]
        ),
        "qps": GaugeMetricFamily(
            "governor_endpoint_qps_limit", "The endpoint's admissions-per-second cap; 0 = none.", labels=["endpoint"]
        ),
        "tokens": GaugeMetricFamily(
            "governor_endpoint_qps_tokens", "Admissions the endpoint's qps bucket holds now.", labels=["endpoint"]
        ),
    }
    for link in s.upstream.links:
        e = link.endpoint
        label = [link.address]
        families["up"].add_metric(label, int(e.up))
        families["inflight"].add_metric(label, e.inflight)
        families["executed"].add_metric(label, e.executed)
        families["failed"].add_metric(label, e.failed)
        families["concurrency"].add_metric(label, e.limits.concurrency)
        families["qps"].add_metric(label, e.limits.qps)
        if e.bucket is not None:
            families["tokens"].add_metric(label, e.bucket.level(now))
    yield from families.values()


class GovernorCollector(Collector):
    def __init__(self, state: ServerState) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        s = self._state
        acc = s.accounting
        yield GaugeMetricFamily(
            "governor_inflight", "Admitted generate requests without a final reply.", s.limiter.inflight
        )
        yield GaugeMetricFamily("governor_max_inflight", "Hard cap on governor_inflight.", s.limiter.max_inflight)
        yield GaugeMetricFamily("governor_connections", "Open client connections.", len(s.connections))
        yield GaugeMetricFamily("governor_draining", "1 while the governor drains for shutdown.", int(s.draining))
        yield CounterMetricFamily(
            "governor_received", "Generate frames received (incl. unreadable ones).", acc.received
        )
        yield CounterMetricFamily("governor_executed", "Requests that ended with a done reply.", acc.executed)
        for name, help_text, by_reason in (
            ("governor_connections_shed", "Client connections the governor closed, by reason.", s.shed),
            ("governor_yielded", "Frames answered with yield, by the limit that refused them.", acc.yielded),
            ("governor_rejected", "Frames refused as invalid, by error code.", acc.rejected),
            ("governor_failed", "Admitted requests that failed, by reason.", acc.failed),
        ):
            family = CounterMetricFamily(name, help_text, labels=["reason"])
            for reason, n in sorted(by_reason.items()):
                family.add_metric([reason], n)
            yield family
        yield from _endpoint_families(s)
        if s.pool.bucket is not None:
            yield GaugeMetricFamily(
                "governor_qps_tokens",
                "Admissions the --max-qps token bucket holds now.",
                s.pool.bucket.level(s.clock()),
            )
        yield from _worker_stats_families(s.upstream.links)
        yield CounterMetricFamily(
            "governor_worker_restarts", "Spawned workers restarted after exiting.", s.worker_restarts
        )
        yield CounterMetricFamily(
            "governor_rerouted", "Requests moved to another endpoint after theirs was lost before starting.", s.rerouted
        )
        for attr, help_text in _HISTOGRAM_HELP.items():
            h: Histogram = getattr(s.latency, attr)
            yield HistogramMetricFamily(
                f"governor_{attr}_seconds", help_text, buckets=h.cumulative(), sum_value=h.total
            )


def build_registry(state: ServerState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GovernorCollector(state))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
