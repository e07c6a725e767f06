"""Server-wide state shared by every connection (uvicorn's ServerState idea).

One object holds the limiter, the endpoint pool, the hint estimator, the accounting and the open connections, and
`finish` is the single place a slot is released, so "released exactly once" is checkable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from governor.accounting import Accounting, Outcome
from governor.admission import InflightLimiter, RetryHintEstimator
from governor.auth import SharedSecret
from governor.errors import GovernorError
from governor.metrics import LatencyMetrics
from governor.pool import Endpoint, Pool
from governor.validation import GenerateRequest, Limits

log = logging.getLogger("governor.state")

# Why the governor closed a client connection (governor_connections_shed_total{reason}).
SHED_MAX_CONNECTIONS = "max_connections"
SHED_IDLE = "idle_timeout"
SHED_BUFFER = "buffer_bytes"
SHED_WRITE_BUFFER = "write_buffer"
SHED_UNAUTHORIZED = "unauthorized"
SHED_REASONS = (SHED_MAX_CONNECTIONS, SHED_IDLE, SHED_BUFFER, SHED_WRITE_BUFFER, SHED_UNAUTHORIZED)

if TYPE_CHECKING:
    from governor.upstream import Upstream, WorkerLink


class RequestOwner(Protocol):
    """The client connection an admitted request answers to."""

    active: dict[str, InflightRequest]

    def worker_frame(self, request: InflightRequest, frame: dict[str, Any]) -> None: ...

    def worker_token(self, request: InflightRequest, rest: bytes) -> None: ...

    def worker_lost(self, request: InflightRequest, message: str) -> None: ...

    def flush(self) -> None: ...


class ClientConnection(Protocol):
    """A client transport as the server sees it: during drain and shutdown, and when shedding."""

    @property
    def ingress(self) -> RequestOwner | None: ...

    @property
    def buffered_bytes(self) -> int: ...

    def close(self) -> None: ...

    def shed(self, reason: str, error: GovernorError | None = None) -> None: ...

    def check_timeouts(self, now: float) -> None: ...


class InflightRequest:
    """What the governor keeps for one admitted request; dropped at its final reply."""

    __slots__ = (
        "client_id",
        "uid",
        "stream",
        "owner",
        "endpoint",
        "link",
        "generate",
        "t_received",
        "t_first_token",
        "settled",
    )

    def __init__(
        self, client_id: str, stream: bool, owner: RequestOwner, t_received: float, endpoint: Endpoint | None
    ) -> None:
        self.client_id = client_id
        self.endpoint = endpoint  # the endpoint whose slot it holds (None when no endpoint was up)
        self.uid = ""  # assigned by the upstream on dispatch; unique across all connections
        self.stream = stream
        self.owner = owner
        self.link: WorkerLink | None = None
        # Kept until its first token, to re-route it once if its worker is lost before starting
        self.generate: GenerateRequest | None = None
        self.t_received = t_received
        self.t_first_token: float | None = None
        self.settled = False


class ServerState:
    __slots__ = (
        "limits",
        "limiter",
        "pool",
        "hints",
        "upstream",
        "clock",
        "accounting",
        "latency",
        "connections",
        "draining",
        "worker_restarts",
        "rerouted",
        "auth",
        "shed",
        "buffered_bytes",
    )

    def __init__(
        self,
        limits: Limits,
        limiter: InflightLimiter,
        pool: Pool,
        hints: RetryHintEstimator,
        upstream: Upstream,
        clock: Callable[[], float] = time.monotonic,
        auth: SharedSecret | None = None,
    ) -> None:
        self.limits = limits
        self.limiter = limiter
        self.pool = pool
        self.hints = hints
        self.upstream = upstream
        self.clock = clock
        self.accounting = Accounting()
        self.latency = LatencyMetrics()
        self.connections: set[ClientConnection] = set()
        self.draining = False
        self.worker_restarts = 0
        self.rerouted = 0  # requests moved to another endpoint after theirs was lost
        self.auth = auth  # when set, every connection must open with a matching `auth` frame
        self.shed = dict.fromkeys(SHED_REASONS, 0)  # connections the governor closed, by reason
        self.buffered_bytes = 0  # unfinished-frame bytes held over all connections

    def finish(self, request: InflightRequest, outcome: Outcome, reason: str = "") -> None:
        """Settle an admitted request: free its slot, count it, forget it everywhere. Exactly once:
        a second call (a late frame racing a disconnect, say) must not free someone else's slot."""
        if request.settled:
            log.error("event=double_settle id=%r outcome=%s", request.client_id, outcome.value)
            return
        request.settled = True
        self.limiter.release()
        if request.endpoint is not None:
            self.pool.release(request.endpoint, executed=outcome is Outcome.EXECUTED)
        self.accounting.record(outcome, reason)
        request.owner.active.pop(request.client_id, None)
        if request.link is not None:
            request.link.inflight.pop(request.uid, None)
        if request.link is None:
            return  # never reached a worker (invalid after admission, or no worker): no duration
        elapsed = self.clock() - request.t_received
        self.latency.request_duration.observe(elapsed)
        if outcome is Outcome.EXECUTED:
            self.hints.observe_service_time(elapsed)

    def snapshot(self) -> dict[str, Any]:
        """The `stats` reply body."""
        acc = self.accounting
        return {
            "inflight": self.limiter.inflight,
            "max_inflight": self.limiter.max_inflight,
            "max_qps": 0.0 if self.pool.bucket is None else self.pool.bucket.rate,
            "qps_tokens": None if self.pool.bucket is None else round(self.pool.bucket.level(self.clock()), 3),
            "received_total": acc.received,
            "executed_total": acc.executed,
            "yielded_total": acc.yielded_total,
            "rejected_total": acc.rejected_total,
            "failed_total": acc.failed_total,
            "yielded_by_reason": dict(acc.yielded),
            "rejected_by_reason": dict(acc.rejected),
            "failed_by_reason": dict(acc.failed),
            "connections": len(self.connections),
            "draining": self.draining,
            "service_time_ms": None
            if self.hints.service_time_s is None
            else round(self.hints.service_time_s * 1000, 3),
            "worker_restarts": self.worker_restarts,
            "rerouted_total": self.rerouted,
            "connections_shed": dict(self.shed),
            "workers": [link.describe() for link in self.upstream.links],
        }
