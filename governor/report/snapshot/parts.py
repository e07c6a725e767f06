"""The readings of admission's and accounting's parts: frozen values, each read from its live
object by `of`, and written in the `stats` form by `to_dict` (raw here, rounded there)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from governor.accounting import Accounting
from governor.admission.adaptive_limit import AdaptiveMode
from governor.admission.buckets import TokenBucket
from governor.admission.cost import CostModel
from governor.admission.decision import Admission
from governor.admission.tally import Tally
from governor.admission.tenant import Tenant, TenantLimits
from governor.latency import Histogram, LatencyMetrics
from govwire.vocab import Priority

HISTOGRAMS = ("admission_decision", "queue_wait", "time_to_first_token", "request_duration", "event_loop_lag")
"""The latency histograms (latency.LatencyMetrics), in the order they are exported."""
DISPLACEABLE = (Priority.SHEDDABLE, Priority.STANDARD)
"""The classes a higher one can displace: their `preempted` series exist from the first read."""


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@dataclass(frozen=True, slots=True)
class HistogramReading:
    """A histogram's cumulative buckets (`le`, count) and the sum of its samples."""

    buckets: tuple[tuple[str, float], ...]
    total: float

    @classmethod
    def of(cls, histogram: Histogram) -> HistogramReading:
        return cls(tuple(histogram.cumulative()), histogram.total)

    @property
    def count(self) -> int:
        return int(self.buckets[-1][1])


@dataclass(frozen=True, slots=True)
class BucketReading:
    """A token bucket: its rate, and what it holds now."""

    rate: float
    level: float

    @classmethod
    def of(cls, bucket: TokenBucket | None, now: float) -> BucketReading | None:
        return None if bucket is None else cls(bucket.rate, bucket.level(now))


@dataclass(frozen=True, slots=True)
class TallyReading:
    """One tenant's or priority class's counts (admission/tally.py)."""

    admitted: int
    executed: int
    inflight: int
    yielded: Mapping[str, int]  # every reason, 0 included
    tokens_settled: int

    @classmethod
    def of(cls, tally: Tally) -> TallyReading:
        return cls(tally.admitted, tally.executed, tally.inflight, dict(tally.yielded), tally.tokens_settled)

    @property
    def yielded_total(self) -> int:
        return sum(self.yielded.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "admitted_total": self.admitted,
            "executed_total": self.executed,
            "yielded_total": self.yielded_total,
            "yielded_by_reason": {reason: n for reason, n in self.yielded.items() if n},
            "tokens_settled_total": self.tokens_settled,
        }


@dataclass(frozen=True, slots=True)
class TenantReading:
    """A tenant's limits, what it holds and its tally; `service_lead`: how far its fair-share
    counter is ahead of the lowest contending one (weighted tokens; 0 for the least served)."""

    name: str
    limits: TenantLimits
    inflight: int
    inflight_tokens: int
    tally: TallyReading
    contending: bool
    service_lead: float

    def to_dict(self) -> dict[str, Any]:
        tally = self.tally.to_dict()
        return {
            "name": self.name,
            **dataclasses.asdict(self.limits),
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            **tally,
            "contending": self.contending,
            "service_lead": round(self.service_lead, 3),
        }


@dataclass(frozen=True, slots=True)
class ClassReading:
    """A priority class's ceiling now, its displaced requests and its tally."""

    name: str
    ceiling: float
    preempted_total: int
    tally: TallyReading

    def to_dict(self) -> dict[str, Any]:
        return {
            "ceiling": self.ceiling,
            "preempted_total": self.preempted_total,
            "inflight": self.tally.inflight,
            **self.tally.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Who the tenants are named by, when fair shares start, and each tenant's and class's reading;
    `preempted`: displacements by (class, tenant), every displaceable class of every tenant at 0
    until one is (a tenant dropped by a reload keeps its series, so a counter never goes back)."""

    tenant_from: str
    share_from: float | None
    tenants: tuple[TenantReading, ...]
    classes: tuple[ClassReading, ...]
    preempted: Mapping[tuple[str, str], int]

    @classmethod
    def of(cls, admission: Admission, accounting: Accounting, tenant_from: str, now: float) -> Tenancy:
        total = admission.displacement.total
        lowest, _, _ = admission.fair.floor(now)
        tenants = tuple(_tenant(tenant, now, lowest) for tenant in admission.tenants)
        keys = {(p.value, t.name) for p in DISPLACEABLE for t in tenants} | total.keys()
        return cls(
            tenant_from,
            admission.fair.threshold,
            tenants,
            _classes(admission, accounting, now),
            {key: total.get(key, 0) for key in sorted(keys)},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant_from": self.tenant_from,
            "tenant_share_from": self.share_from,
            "tenants": [tenant.to_dict() for tenant in self.tenants],
            "classes": {c.name: c.to_dict() for c in self.classes},
        }


def _tenant(tenant: Tenant, now: float, lowest: float) -> TenantReading:
    """`lowest`: the least served contending tenant's fair-share counter (inf when none contends)."""
    return TenantReading(
        tenant.name,
        tenant.limits,
        tenant.inflight,
        tenant.tokens,
        TallyReading.of(tenant.tally),
        tenant.contending_until > now,
        max(0.0, tenant.service - lowest) if lowest < math.inf else 0.0,
    )


def _classes(admission: Admission, accounting: Accounting, now: float) -> tuple[ClassReading, ...]:
    ceilings = admission.ceilings.current(now)
    preempted: dict[str, int] = {}
    for (priority_class, _), n in admission.displacement.total.items():
        preempted[priority_class] = preempted.get(priority_class, 0) + n
    return tuple(
        ClassReading(p.value, ceilings[p.value], preempted.get(p.value, 0), TallyReading.of(tally))
        for p, tally in accounting.classes.items()
    )


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token-cost admission (admission/cost.py, limits.TokenBudget, limits.TokenRate)."""

    held: int
    max_tokens: int
    rate: BucketReading | None
    reserved_total: int
    settled_total: int
    bytes_per_token: float
    estimate_ratio: Mapping[str, HistogramReading]  # estimated over real prompt tokens, by source

    @classmethod
    def of(cls, admission: Admission, acc: Accounting, costs: CostModel, now: float) -> Tokens:
        return cls(
            admission.tokens.held,
            admission.tokens.max_tokens,
            BucketReading.of(admission.token_rate.bucket, now),
            acc.tokens_reserved,
            acc.tokens_settled,
            costs.bytes_per_token,
            {source: HistogramReading.of(h) for source, h in costs.accuracy.items()},
        )


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Deadline outcomes, and how the TTFT model's predictions held (the margin is learnt to cover
    about 95%, ttft.py); `margins`: each endpoint's margin now."""

    outcomes: Mapping[str, int]  # met, expired
    predictions: Mapping[str, int]  # covered, exceeded
    margins: Mapping[str, float]

    @classmethod
    def of(cls, admission: Admission, acc: Accounting) -> Deadlines:
        margins = {e.name: e.ttft.margin for e in admission.pool.endpoints}
        return cls(dict(acc.deadlines), dict(acc.predictions), margins)

    @property
    def coverage(self) -> float | None:
        """The share of the predicted admissions whose first token came within the prediction."""
        predicted = self.predictions["covered"] + self.predictions["exceeded"]
        return self.predictions["covered"] / predicted if predicted else None

    def to_dict(self) -> dict[str, Any]:
        coverage = self.coverage
        return {
            **self.outcomes,
            **self.predictions,
            "coverage": None if coverage is None else round(coverage, 4),
            "margin_sd": {name: round(margin, 3) for name, margin in self.margins.items()},
        }


@dataclass(frozen=True, slots=True)
class Adaptive:
    """`--adaptive-limit`: the limit, the knee of the engine's step-time line, how much slower than
    that line the latest streams ran, and the step the line predicts at the limit."""

    mode: AdaptiveMode
    limit: int
    knee: int | None
    speed: float
    step_at_limit_s: float | None

    @classmethod
    def of(cls, admission: Admission) -> Adaptive:
        adaptive = admission.adaptive
        return cls(
            adaptive.policy.mode, adaptive.limit, adaptive.knee, adaptive.speed, adaptive.step_at(adaptive.limit)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "limit": self.limit,
            "knee": self.knee,
            "speed": round(self.speed, 4),
            "step_ms_at_limit": ms(self.step_at_limit_s),
        }


@dataclass(frozen=True, slots=True)
class Counts:
    """Where every frame ended up, and the other counters of accounting.py."""

    received: int
    http_received: int  # of `received`, through the HTTP front door
    executed: int
    yielded: Mapping[str, int]
    rejected: Mapping[str, int]
    failed: Mapping[str, int]
    final: Mapping[str, int]  # of the yields, those told not to come back
    attempts: Mapping[str, Mapping[str, int]]  # first / retry -> admitted / yielded
    blind_retries: Mapping[str, int]
    shed: Mapping[str, int]
    worker_restarts: int
    rerouted: int

    @classmethod
    def of(cls, acc: Accounting) -> Counts:
        return cls(
            acc.received,
            acc.http_received,
            acc.executed,
            dict(acc.yielded),
            dict(acc.rejected),
            dict(acc.failed),
            dict(acc.final),
            acc.attempts,
            dict(acc.blind_retries),
            dict(acc.shed),
            acc.worker_restarts,
            acc.rerouted,
        )

    @property
    def received_by_protocol(self) -> dict[str, int]:
        return {"ndjson": self.received - self.http_received, "http": self.http_received}


@dataclass(frozen=True, slots=True)
class Hints:
    """Whether the retry hints hold: each return's outcome by the limit that booked it, the
    appointments open and their clients' trust, and the release forecast's error."""

    outcomes: Mapping[tuple[str, str], int]  # (reason, outcome) -> returns
    appointments: Mapping[str, int]  # open, by reason: every limit that books, from the start
    trust: Mapping[str, float]  # the share of recent appointments their clients kept, by reason
    forecast_error_p50: float | None  # relative to a service time
    forecast_samples: int
    forecast_error: HistogramReading  # seconds, signed
    backfilled: int  # admissions into a slot kept for an appointment due after they end

    @classmethod
    def of(cls, admission: Admission) -> Hints:
        appointments = admission.appointments
        errors = sorted(admission.forecast.relative_errors)
        return cls(
            dict(appointments.outcomes),
            appointments.open_by_reason(),
            appointments.trust_by_reason(),
            errors[len(errors) // 2] if errors else None,
            len(errors),
            HistogramReading.of(admission.forecast.error),
            admission.inflight.backfilled,
        )

    def to_dict(self) -> dict[str, Any]:
        outcomes: dict[str, dict[str, int]] = {}
        for (reason, outcome), n in sorted(self.outcomes.items()):
            outcomes.setdefault(reason, {})[outcome] = n
        p50 = self.forecast_error_p50
        return {
            "outcomes": outcomes,
            "appointments": dict(self.appointments),
            "forecast_relative_error_p50": None if p50 is None else round(p50, 4),
            # the share of recent appointments their clients kept: below 0.5 they keep no capacity
            "trust": {reason: round(v, 4) for reason, v in self.trust.items()},
            "forecast_samples": self.forecast_samples,
            "backfilled_total": self.backfilled,
        }


@dataclass(frozen=True, slots=True)
class Latency:
    """The latency histograms (`HISTOGRAMS`), and the retry hints handed out, by yield reason."""

    histograms: Mapping[str, HistogramReading]
    retry_hints: Mapping[str, HistogramReading]

    @classmethod
    def of(cls, latency: LatencyMetrics) -> Latency:
        return cls(
            {name: HistogramReading.of(getattr(latency, name)) for name in HISTOGRAMS},
            {reason: HistogramReading.of(h) for reason, h in latency.retry_hints.items()},
        )
