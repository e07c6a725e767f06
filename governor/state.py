"""What every client connection shares: the wiring of one governor (uvicorn's ServerState idea).

No logic and no counters of its own: admission decides (admission/decision.py), the lifecycle moves
admitted requests (lifecycle.py), accounting counts (accounting.py). `snapshot` reads them all for
the `stats` reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from governor.accounting import Accounting, ShedReason
from governor.admission.appointments.lobby import Lobby
from governor.admission.cost import CostModel
from governor.admission.decision import Admission
from governor.latency import LatencyMetrics
from governor.lifecycle import Dispatcher, InflightRequest, Lifecycle
from governor.timers import Cancellable, Timers
from govwire.auth import TenantSecrets
from govwire.errors import GovernorError
from govwire.request import Limits

if TYPE_CHECKING:  # a type only: importing the state must not import the Redis client
    from governor.fleet.member import FleetMember


class ClientCore(Protocol):
    """A connection's sans-IO protocol core, as the adapter drives it."""

    write: Callable[[bytes], None]  # swapped by the adapter while the client is not reading
    active: dict[str, InflightRequest]
    tenant: str

    @property
    def closing(self) -> ShedReason | None:
        """Set when the core refused the connection: the adapter sheds it for this reason."""

    @property
    def buffered_bytes(self) -> int: ...

    @property
    def held_frames(self) -> int:
        """Frames of earlier reads waiting for `resume` (the adapter stops reading meanwhile)."""

    def receive_data(self, data: bytes) -> None:
        """Answer what the read completes, or its first slice (the rest is held)."""

    def resume(self, budget: int) -> None:
        """Answer up to `budget` of the frames held back (on a later turn of the loop, see
        doors/turns.py)."""

    def fail_internal(self) -> None: ...

    def connection_lost(self, reason: str = ...) -> None: ...

    def timeout(self, now: float, idle_timeout_s: float) -> tuple[ShedReason, GovernorError | None] | None: ...

    def last_words(self, error: GovernorError) -> bytes: ...


class ClientConnection(Protocol):
    """A client transport as the server sees it: during drain and shutdown, and when shedding."""

    protocol: str  # the front door it came through: "ndjson" or "http"

    @property
    def ingress(self) -> ClientCore | None: ...

    @property
    def buffered_bytes(self) -> int: ...

    def close(self) -> None: ...

    def shed(self, reason: ShedReason, error: GovernorError | None = None) -> None: ...

    def check_timeouts(self, now: float) -> None: ...


class UpstreamView(Dispatcher, Protocol):
    """The links as the state needs them: dispatch, where their answers go, and their
    description for `stats`."""

    def bind(self, lifecycle: Lifecycle) -> None: ...

    def describe(self) -> list[dict[str, Any]]: ...


class LoopTimers:
    """Deadlines on the running event loop."""

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback, *args)


class ServerState:
    __slots__ = (
        "limits",
        "auth",
        "tenant_from_frame",
        "tenant_from",
        "clock",
        "costs",
        "admission",
        "accounting",
        "latency",
        "lifecycle",
        "lobby",
        "timers",
        "upstream",
        "connections",
        "buffered_bytes",
        "fleet",
    )

    def __init__(
        self,
        limits: Limits,
        admission: Admission,
        upstream: UpstreamView,
        clock: Callable[[], float] = time.monotonic,
        auth: TenantSecrets | None = None,
        costs: CostModel | None = None,
        timers: Timers | None = None,
        tenant_from_frame: bool = False,
    ) -> None:
        self.limits = limits  # what a generate frame may ask for
        # When set, every connection must open with a matching `auth` frame; its secret names the
        # connection's tenant. Replaced when SIGHUP re-reads the token file.
        self.auth = auth
        # --tenant-from frame: each frame's `tenant` field names its tenant (the clients are trusted).
        self.tenant_from_frame = tenant_from_frame
        self.tenant_from = "frame" if tenant_from_frame else "auth"  # (--tenant-from header: set by the server)
        self.clock = clock
        self.costs = costs or CostModel(4.0, 1.0, limits.max_new_tokens)  # what a frame costs in tokens
        self.admission = admission
        self.accounting = Accounting()
        self.latency = LatencyMetrics()
        self.upstream = upstream
        timers = self.timers = timers or LoopTimers()
        self.lobby = Lobby(admission, timers, clock)  # returning clients held for their capacity
        self.lifecycle = Lifecycle(
            admission, self.accounting, self.latency, upstream, clock, self.costs, timers, self.lobby.freed
        )
        upstream.bind(self.lifecycle)  # the links end requests through it
        self.connections: set[ClientConnection] = set()
        self.buffered_bytes = 0  # unfinished-frame bytes held over all connections
        self.fleet: FleetMember | None = None  # with --fleet: the lease and its renewals

    def connections_by_protocol(self) -> dict[str, int]:
        counts = {"ndjson": 0, "http": 0}
        for connection in self.connections:
            counts[connection.protocol] = counts.get(connection.protocol, 0) + 1
        return counts

    def snapshot(self) -> dict[str, Any]:
        """The `stats` reply body."""
        acc = self.accounting
        admission = self.admission
        bucket = admission.rate.bucket
        token_bucket = admission.token_rate.bucket
        hints = admission.hints
        now = self.clock()
        return {
            "inflight": admission.inflight.inflight,
            "max_inflight": admission.inflight.max_inflight,
            "configured_max_inflight": admission.max_inflight,
            "max_qps": 0.0 if bucket is None else bucket.rate,
            "qps_tokens": None if bucket is None else round(bucket.level(now), 3),
            "inflight_tokens": admission.tokens.held,
            "max_inflight_tokens": admission.tokens.max_tokens,
            "max_tokens_per_s": 0.0 if token_bucket is None else token_bucket.rate,
            "token_rate_tokens": None if token_bucket is None else round(token_bucket.level(now), 3),
            "tokens_reserved_total": acc.tokens_reserved,
            "tokens_settled_total": acc.tokens_settled,
            "bytes_per_token": round(self.costs.bytes_per_token, 4),
            "deadlines": self._deadlines(),
            "adaptive_limit": self._adaptive(),
            "tenant_from": self.tenant_from,
            "tenant_share_from": admission.fair.threshold,
            "tenants": self._tenants(now),
            "classes": self._classes(now),
            "class_allowance": {"critical": admission.inflight.allowance},
            "fleet": None if self.fleet is None else self.fleet.describe(),
            "received_total": acc.received,
            "executed_total": acc.executed,
            "yielded_total": acc.yielded_total,
            "rejected_total": acc.rejected_total,
            "failed_total": acc.failed_total,
            "yielded_by_reason": dict(acc.yielded),
            "rejected_by_reason": dict(acc.rejected),
            "failed_by_reason": dict(acc.failed),
            "connections": len(self.connections),
            "connections_by_protocol": self.connections_by_protocol(),
            "received_by_protocol": {"ndjson": acc.received - acc.http_received, "http": acc.http_received},
            "draining": admission.draining,
            "service_time_ms": None if hints.service_time_s is None else round(hints.service_time_s * 1000, 3),
            "retry_hints": self._retry_hints(),
            "lobby": {"held": len(self.lobby), "answered_total": self.lobby.wait.count},
            "final_by_reason": dict(acc.final),
            # Admission's answers to first attempts and retries (a blind retry held no appointment).
            "attempts": {**acc.attempts, "blind_retry": dict(acc.blind_retries)},
            "shed_blind_retries": admission.shed_blind_retries,
            "worker_restarts": acc.worker_restarts,
            "rerouted_total": acc.rerouted,
            "connections_shed": dict(acc.shed),
            "workers": self.upstream.describe(),
        }

    def _adaptive(self) -> dict[str, Any]:
        """`--adaptive-limit`: the limit, the knee of the engine's step-time line, how much slower
        than that line the latest streams ran, and the step the line predicts at the limit."""
        adaptive = self.admission.adaptive
        step = adaptive.step_at(adaptive.limit)
        return {
            "mode": adaptive.policy.mode.value,
            "limit": adaptive.limit,
            "knee": adaptive.knee,
            "speed": round(adaptive.speed, 4),
            "step_ms_at_limit": None if step is None else round(step * 1000, 3),
        }

    def _deadlines(self) -> dict[str, Any]:
        """Deadline outcomes, and how the TTFT model's predictions held: `coverage`, the share of
        the predicted admissions whose first token came within the prediction (the margin is
        learnt to make it about 95%, ttft.py), and each endpoint's margin now."""
        acc = self.accounting
        predicted = acc.predictions["covered"] + acc.predictions["exceeded"]
        return {
            **acc.deadlines,
            **acc.predictions,
            "coverage": round(acc.predictions["covered"] / predicted, 4) if predicted else None,
            "margin_sd": {e.name: round(e.ttft.margin, 3) for e in self.admission.pool.endpoints},
        }

    def _retry_hints(self) -> dict[str, Any]:
        """Whether the hints hold: each return's outcome by the limit that booked it, the
        appointments open, and the release forecast's median error relative to a service time."""
        admission = self.admission
        admission.appointments.tidy(self.clock())  # closed windows lapse, no-shows count, before a report
        outcomes: dict[str, dict[str, int]] = {}
        for (reason, outcome), n in sorted(admission.appointments.outcomes.items()):
            outcomes.setdefault(reason, {})[outcome] = n
        errors = sorted(admission.forecast.relative_errors)
        return {
            "outcomes": outcomes,
            "appointments": admission.appointments.open_by_reason(),
            "forecast_relative_error_p50": round(errors[len(errors) // 2], 4) if errors else None,
            # the share of recent appointments their clients kept: below 0.5 they keep no capacity
            "trust": {reason: round(v, 4) for reason, v in admission.appointments.trust_by_reason().items()},
            "forecast_samples": len(errors),
        }

    def _tenants(self, now: float) -> list[dict[str, Any]]:
        """Each tenant's limits, what it holds and its tally; `service_lead`: how far its fair-share
        counter is ahead of the lowest contending one (weighted tokens; 0 for the least served)."""
        fair = self.admission.fair
        lowest, _, _ = fair.floor(now)
        rows = []
        for tenant in self.admission.tenants:
            tally = tenant.tally
            rows.append(
                {
                    "name": tenant.name,
                    **dataclasses.asdict(tenant.limits),
                    "inflight": tenant.inflight,
                    "inflight_tokens": tenant.tokens,
                    "admitted_total": tally.admitted,
                    "executed_total": tally.executed,
                    "yielded_total": tally.yielded_total,
                    "yielded_by_reason": {reason: n for reason, n in tally.yielded.items() if n},
                    "tokens_settled_total": tally.tokens_settled,
                    "contending": tenant.contending_until > now,
                    "service_lead": round(max(0.0, tenant.service - lowest), 3) if lowest < math.inf else 0.0,
                }
            )
        return rows

    def _classes(self, now: float) -> dict[str, dict[str, Any]]:
        """Each priority class's ceiling now and its tally."""
        ceilings = self.admission.ceilings.current(now)
        preempted: dict[str, int] = {}
        for (priority_class, _), n in self.admission.displacement.total.items():
            preempted[priority_class] = preempted.get(priority_class, 0) + n
        return {
            priority.value: {
                "ceiling": ceilings[priority.value],
                "preempted_total": preempted.get(priority.value, 0),
                "inflight": tally.inflight,
                "admitted_total": tally.admitted,
                "executed_total": tally.executed,
                "yielded_total": tally.yielded_total,
                "yielded_by_reason": {reason: n for reason, n in tally.yielded.items() if n},
                "tokens_settled_total": tally.tokens_settled,
            }
            for priority, tally in self.accounting.classes.items()
        }
