"""What every client connection shares: the wiring of one governor (uvicorn's ServerState idea).

No logic and no counters of its own: admission decides (admission/decision.py), the lifecycle moves
admitted requests (lifecycle.py), accounting counts (accounting.py). The read side reads them all
(report/snapshot/), for the `stats` reply too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from governor.accounting import Accounting, ShedReason
from governor.admission.appointments.lobby import Lobby
from governor.admission.cost import CostModel
from governor.admission.decision import Admission
from governor.latency import LatencyMetrics
from governor.lifecycle import Dispatcher, InflightRequest, Lifecycle
from governor.report.snapshot.reading import read
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
        self.lifecycle = Lifecycle(
            admission, self.accounting, self.latency, upstream, clock, self.costs, timers, self._capacity_freed
        )
        # Returning clients held for their capacity, decided again as the lifecycle decides.
        self.lobby = Lobby(admission, self.lifecycle.decide, timers, clock)
        upstream.bind(self.lifecycle)  # the links end requests through it
        self.connections: set[ClientConnection] = set()
        self.buffered_bytes = 0  # unfinished-frame bytes held over all connections
        self.fleet: FleetMember | None = None  # with --fleet: the lease and its renewals

    def _capacity_freed(self) -> None:
        """The lifecycle released capacity: the lobby decides its held frames again (next turn)."""
        self.lobby.freed()

    def connections_by_protocol(self) -> dict[str, int]:
        counts = {"ndjson": 0, "http": 0}
        for connection in self.connections:
            counts[connection.protocol] = counts.get(connection.protocol, 0) + 1
        return counts

    def snapshot(self) -> dict[str, Any]:
        """The `stats` reply body: the read side's one reading of the parts (report/snapshot/)."""
        return read(self).to_dict()
