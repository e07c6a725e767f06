"""What every client connection shares: the wiring of one governor (uvicorn's ServerState idea).

No logic and no counters of its own: admission decides (admission.py), the lifecycle moves
admitted requests (lifecycle.py), accounting counts (accounting.py). `snapshot` reads them all for
the `stats` reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from governor.accounting import Accounting, ShedReason
from governor.admission import Admission
from governor.latency import LatencyMetrics
from governor.lifecycle import Dispatcher, Lifecycle, RequestOwner
from govwire.auth import SharedSecret
from govwire.errors import GovernorError
from govwire.request import Limits


class ClientConnection(Protocol):
    """A client transport as the server sees it: during drain and shutdown, and when shedding."""

    @property
    def ingress(self) -> RequestOwner | None: ...

    @property
    def buffered_bytes(self) -> int: ...

    def close(self) -> None: ...

    def shed(self, reason: ShedReason, error: GovernorError | None = None) -> None: ...

    def check_timeouts(self, now: float) -> None: ...


class UpstreamView(Dispatcher, Protocol):
    """The worker links as the state needs them: dispatch, and their description for `stats`."""

    def describe(self) -> list[dict[str, Any]]: ...


class ServerState:
    __slots__ = (
        "limits",
        "auth",
        "clock",
        "admission",
        "accounting",
        "latency",
        "lifecycle",
        "upstream",
        "connections",
        "buffered_bytes",
    )

    def __init__(
        self,
        limits: Limits,
        admission: Admission,
        upstream: UpstreamView,
        clock: Callable[[], float] = time.monotonic,
        auth: SharedSecret | None = None,
    ) -> None:
        self.limits = limits  # what a generate frame may ask for
        self.auth = auth  # when set, every connection must open with a matching `auth` frame
        self.clock = clock
        self.admission = admission
        self.accounting = Accounting()
        self.latency = LatencyMetrics()
        self.upstream = upstream
        self.lifecycle = Lifecycle(admission, self.accounting, self.latency, upstream, clock)
        self.connections: set[ClientConnection] = set()
        self.buffered_bytes = 0  # unfinished-frame bytes held over all connections

    def snapshot(self) -> dict[str, Any]:
        """The `stats` reply body."""
        acc = self.accounting
        admission = self.admission
        bucket = admission.rate.bucket
        hints = admission.hints
        return {
            "inflight": admission.inflight.inflight,
            "max_inflight": admission.inflight.max_inflight,
            "max_qps": 0.0 if bucket is None else bucket.rate,
            "qps_tokens": None if bucket is None else round(bucket.level(self.clock()), 3),
            "received_total": acc.received,
            "executed_total": acc.executed,
            "yielded_total": acc.yielded_total,
            "rejected_total": acc.rejected_total,
            "failed_total": acc.failed_total,
            "yielded_by_reason": dict(acc.yielded),
            "rejected_by_reason": dict(acc.rejected),
            "failed_by_reason": dict(acc.failed),
            "connections": len(self.connections),
            "draining": admission.draining,
            "service_time_ms": None if hints.service_time_s is None else round(hints.service_time_s * 1000, 3),
            "worker_restarts": acc.worker_restarts,
            "rerouted_total": acc.rerouted,
            "connections_shed": dict(acc.shed),
            "workers": self.upstream.describe(),
        }
