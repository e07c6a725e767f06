"""`read`: the whole governor read once into a `Snapshot`, through what it reads of the state
(`Wiring`: state.ServerState, which this layer sits below)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from governor.accounting import Accounting
from governor.admission.adaptive_limit import AdaptiveMode
from governor.admission.cost import CostModel
from governor.admission.decision import Admission
from governor.latency import Histogram, LatencyMetrics
from governor.report.snapshot.fleet import FleetReading
from governor.report.snapshot.parts import (
    Adaptive,
    BucketReading,
    Counts,
    Deadlines,
    Hints,
    HistogramReading,
    Latency,
    Tenancy,
    Tokens,
    ms,
)

if TYPE_CHECKING:  # a type only: reading the state must not import the Redis client
    from governor.fleet.member import FleetMember


class Held(Protocol):
    """The lobby as the read side sees it: how many it holds, and how long they were held."""

    @property
    def wait(self) -> Histogram: ...

    def __len__(self) -> int: ...


class Described(Protocol):
    """The links as the read side sees them: their own description (the `stats` workers)."""

    def describe(self) -> list[dict[str, Any]]: ...


class Wiring(Protocol):
    """What the read side reads of the wiring (state.ServerState)."""

    @property
    def admission(self) -> Admission: ...
    @property
    def accounting(self) -> Accounting: ...
    @property
    def costs(self) -> CostModel: ...
    @property
    def latency(self) -> LatencyMetrics: ...
    @property
    def lobby(self) -> Held: ...
    @property
    def upstream(self) -> Described: ...
    @property
    def fleet(self) -> FleetMember | None: ...
    @property
    def tenant_from(self) -> str: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def connections(self) -> Sized: ...

    def connections_by_protocol(self) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The governor at one moment, read once (`read`): what `stats`, /metrics and `governor
    status` show."""

    inflight: int
    max_inflight: int  # the cap in force (the adaptive limit under --adaptive-limit enforce)
    configured_max_inflight: int  # --max-inflight
    critical_allowance: int  # --class-allowance critical=D
    qps: BucketReading | None  # --max-qps
    draining: bool
    service_time_s: float | None
    shed_blind_retries: bool
    connections: int
    connections_by_protocol: Mapping[str, int]
    lobby_held: int
    lobby_wait: HistogramReading
    tokens: Tokens
    deadlines: Deadlines
    adaptive: Adaptive
    tenancy: Tenancy
    counts: Counts
    hints: Hints
    latency: Latency
    fleet: FleetReading | None
    workers: tuple[Mapping[str, Any], ...]  # the links' own description (links/)

    @property
    def adaptive_limit(self) -> int:
        """The limit --adaptive-limit sets (enforce) or would set (shadow); --max-inflight when off."""
        return self.configured_max_inflight if self.adaptive.mode is AdaptiveMode.OFF else self.adaptive.limit

    def to_dict(self) -> dict[str, Any]:
        """The `stats` reply body (docs/protocol.md)."""
        return {**self._caps_dict(), **self.tenancy.to_dict(), **self._totals_dict()}

    def _caps_dict(self) -> dict[str, Any]:
        qps, tokens = self.qps, self.tokens
        return {
            "inflight": self.inflight,
            "max_inflight": self.max_inflight,
            "configured_max_inflight": self.configured_max_inflight,
            "max_qps": 0.0 if qps is None else qps.rate,
            "qps_tokens": None if qps is None else round(qps.level, 3),
            "inflight_tokens": tokens.held,
            "max_inflight_tokens": tokens.max_tokens,
            "max_tokens_per_s": 0.0 if tokens.rate is None else tokens.rate.rate,
            "token_rate_tokens": None if tokens.rate is None else round(tokens.rate.level, 3),
            "tokens_reserved_total": tokens.reserved_total,
            "tokens_settled_total": tokens.settled_total,
            "bytes_per_token": round(tokens.bytes_per_token, 4),
            "deadlines": self.deadlines.to_dict(),
            "adaptive_limit": self.adaptive.to_dict(),
        }

    def _totals_dict(self) -> dict[str, Any]:
        c = self.counts
        return {
            "class_allowance": {"critical": self.critical_allowance},
            "fleet": None if self.fleet is None else self.fleet.to_dict(),
            "received_total": c.received,
            "executed_total": c.executed,
            "yielded_total": sum(c.yielded.values()),
            "rejected_total": sum(c.rejected.values()),
            "failed_total": sum(c.failed.values()),
            "yielded_by_reason": dict(c.yielded),
            "rejected_by_reason": dict(c.rejected),
            "failed_by_reason": dict(c.failed),
            "connections": self.connections,
            "connections_by_protocol": dict(self.connections_by_protocol),
            "received_by_protocol": c.received_by_protocol,
            "draining": self.draining,
            "service_time_ms": ms(self.service_time_s),
            "retry_hints": self.hints.to_dict(),
            "lobby": {"held": self.lobby_held, "answered_total": self.lobby_wait.count},
            "final_by_reason": dict(c.final),
            # Admission's answers to first attempts and retries (a blind retry held no appointment).
            "attempts": {**c.attempts, "blind_retry": dict(c.blind_retries)},
            "shed_blind_retries": self.shed_blind_retries,
            "worker_restarts": c.worker_restarts,
            "rerouted_total": c.rerouted,
            "connections_shed": dict(c.shed),
            "workers": list(self.workers),
        }


def read(wiring: Wiring) -> Snapshot:
    """Everything the read side shows, at the state's clock now. The appointments' closed windows
    lapse first (no-shows count), as before every report."""
    admission = wiring.admission
    now = wiring.clock()
    admission.appointments.tidy(now)
    lobby = wiring.lobby
    return Snapshot(
        inflight=admission.inflight.inflight,
        max_inflight=admission.inflight.max_inflight,
        configured_max_inflight=admission.max_inflight,
        critical_allowance=admission.inflight.allowance,
        qps=BucketReading.of(admission.rate.bucket, now),
        draining=admission.draining,
        service_time_s=admission.hints.service_time_s,
        shed_blind_retries=admission.shed_blind_retries,
        connections=len(wiring.connections),
        connections_by_protocol=wiring.connections_by_protocol(),
        lobby_held=len(lobby),
        lobby_wait=HistogramReading.of(lobby.wait),
        tokens=Tokens.of(admission, wiring.accounting, wiring.costs, now),
        deadlines=Deadlines.of(admission, wiring.accounting),
        adaptive=Adaptive.of(admission),
        tenancy=Tenancy.of(admission, wiring.accounting, wiring.tenant_from, now),
        counts=Counts.of(wiring.accounting),
        hints=Hints.of(admission),
        latency=Latency.of(wiring.latency),
        fleet=None if wiring.fleet is None else FleetReading.of(wiring.fleet),
        workers=tuple(wiring.upstream.describe()),
    )
