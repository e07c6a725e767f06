"""Per-request client timestamps → the figures `governor bench` reports.

Definitions (docs/benchmarks/sittings.md repeats them):
- TTFT = first token − submit; TPOT = (last token − first token) / (tokens − 1), requests with one
  token excluded; ITL = every gap between consecutive tokens, pooled over requests;
  latency = final reply − submit (the first submission, when retried); yield latency = submit →
  `yield` reply, for every yielded attempt; submit→ack = the admitted attempt's submission → its
  `accepted` reply.
- Yielded and failed requests are excluded from token and latency figures.
- Timestamps are the client's monotonic clock, in seconds; figures are reported in ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        return cls(
            count=len(values),
            mean=sum(values) / len(values) if values else None,
            p50=percentile(values, 50),
            p95=percentile(values, 95),
            p99=percentile(values, 99),
        )


@dataclass(slots=True)
class RequestSample:
    """What the client saw of one request (times in seconds on its monotonic clock)."""

    t_submit: float
    status: str = ""  # final status: done | yield | error; "" while unanswered
    t_final: float | None = None
    token_times: list[float] = field(default_factory=list)
    code: str | None = None  # error code, or yield reason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 0  # submissions, retries included
    yield_latencies: list[float] = field(default_factory=list)  # submit -> yield, for every yielded attempt
    ack_latency: float | None = None  # the admitted attempt's submit -> accepted
    server: dict[str, float] = field(default_factory=dict)  # the server's own timings from `done` (ms)
    group: str = ""  # its --tenant-mix entry (TenantGroup.label); "" without a mix

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.t_submit if self.status == "done" and self.token_times else None

    @property
    def tpot(self) -> float | None:
        times = self.token_times
        if self.status != "done" or len(times) < 2:
            return None
        return (times[-1] - times[0]) / (len(times) - 1)

    @property
    def itls(self) -> list[float]:
        if self.status != "done":
            return []
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def latency(self) -> float | None:
        return self.t_final - self.t_submit if self.status == "done" and self.t_final is not None else None


def _ms(values: list[float]) -> list[float]:
    return [v * 1000 for v in values]


@dataclass(frozen=True, slots=True)
class DeadlineOutcomes:
    """Requests sent with a deadline: admitted ones whose first token came in time (as the client
    measured it), admitted ones that did not (cancelled with `deadline_exceeded`, or late), and
    those refused at once (yield reason `deadline`)."""

    met: int
    missed: int
    refused: int

    @property
    def met_share(self) -> float:
        """Of the admitted requests, the share that met the deadline."""
        admitted = self.met + self.missed
        return self.met / admitted if admitted else 0.0


@dataclass(frozen=True, slots=True)
class Summary:
    offered: int  # requests of the workload (each counted once, however often retried)
    requests: int  # completed with done
    yielded: int  # yielded finally, after any retries
    retries: int
    errors: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    latency_ms: Distribution
    yield_latency_ms: Distribution  # every yield reply, retried or final
    ack_ms: Distribution  # admitted attempts: submit -> accepted
    goodput_rps: float  # done requests meeting both SLOs, per second of wall time
    yielded_by_reason: dict[str, int] = field(default_factory=dict)  # final yields
    deadlines: DeadlineOutcomes | None = None  # with --deadline-ms

    @property
    def retry_amplification(self) -> float:
        """Attempts per completed request (1.0 = no retries)."""
        return (self.requests + self.retries) / self.requests if self.requests else 0.0

    @property
    def executed_rps(self) -> float:
        """Completed requests per second of wall time, whatever their latency (goodput without SLOs)."""
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens of the completed requests: the service they got."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def summarize(
    samples: Sequence[RequestSample],
    wall_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    deadline_ms: float | None = None,
) -> Summary:
    done = [s for s in samples if s.status == "done"]
    errors: dict[str, int] = {}
    for s in samples:
        if s.status == "error":
            key = s.code or "unknown"
            errors[key] = errors.get(key, 0) + 1

    def meets_slo(s: RequestSample) -> bool:
        ttft, tpot = s.ttft, s.tpot
        if slo_ttft_ms is not None and (ttft is None or ttft * 1000 > slo_ttft_ms):
            return False
        return slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms

    good = sum(meets_slo(s) for s in done)
    yielded: dict[str, int] = {}
    for s in samples:
        if s.status == "yield":
            yielded[s.code or "unknown"] = yielded.get(s.code or "unknown", 0) + 1
    deadlines = None
    if deadline_ms:
        met = sum(1 for s in done if (t := s.ttft) is not None and t * 1000 <= deadline_ms)
        missed = len(done) - met + errors.get("deadline_exceeded", 0)
        deadlines = DeadlineOutcomes(met=met, missed=missed, refused=yielded.get("deadline", 0))
    return Summary(
        offered=len(samples),
        requests=len(done),
        yielded=sum(s.status == "yield" for s in samples),
        retries=sum(max(0, s.attempts - 1) for s in samples),
        errors=errors,
        prompt_tokens=sum(s.prompt_tokens for s in done),
        completion_tokens=sum(s.completion_tokens for s in done),
        wall_s=wall_s,
        ttft_ms=Distribution.of(_ms([t for s in done if (t := s.ttft) is not None])),
        tpot_ms=Distribution.of(_ms([t for s in done if (t := s.tpot) is not None])),
        itl_ms=Distribution.of(_ms([gap for s in done for gap in s.itls])),
        latency_ms=Distribution.of(_ms([t for s in done if (t := s.latency) is not None])),
        yield_latency_ms=Distribution.of(_ms([t for s in samples for t in s.yield_latencies])),
        ack_ms=Distribution.of(_ms([t for s in samples if (t := s.ack_latency) is not None])),
        goodput_rps=good / wall_s if wall_s > 0 else 0.0,
        yielded_by_reason=yielded,
        deadlines=deadlines,
    )
