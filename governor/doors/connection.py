"""asyncio transport adapter: moves bytes between a client socket and its protocol core (the
NDJSON `Ingress`, or the HTTP front door's `HttpIngress`), and keeps one connection from hurting
the others.

Flow control: a client that does not read its replies stops being read (its socket buffer
fills, the transport calls `pause_writing`). Replies to requests already in flight still queue
up; past `max_write_buffer_bytes` the connection is cut. Memory: an unfinished frame holds at
most `max_frame_bytes` per connection, and `max_buffer_bytes` over all of them; past that, the
connection holding the most is shed. Idle connections, connections past `max_connections` and,
with auth on, connections that do not authenticate in time are closed with a typed error reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from governor.accounting import CONNECTION_SHED, ShedReason
from governor.doors.ndjson import Ingress
from governor.doors.turns import FRAMES_PER_TURN, TurnQueue
from governor.state import ClientCore, ServerState
from govwire.address import Address
from govwire.errors import BufferFull, GovernorError, TooManyConnections

# The logger keeps its name from before the file moved: it is in every log line (logger=governor.protocol).
log = logging.getLogger("governor.protocol")


CoreFactory = Callable[[ServerState, Callable[[bytes], None], "GovernorProtocol"], ClientCore]


def ndjson_core(state: ServerState, write: Callable[[bytes], None], protocol: GovernorProtocol) -> ClientCore:
    return Ingress(state, write, protocol.limits.max_frame_bytes)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_frame_bytes: int = 1024 * 1024
    max_connections: int = 10_000
    max_buffer_bytes: int = 256 * 1024 * 1024
    max_write_buffer_bytes: int = 8 * 1024 * 1024
    idle_timeout_s: float = 300.0  # 0 = never


class GovernorProtocol(asyncio.Protocol):
    __slots__ = (
        "_state",
        "limits",
        "_transport",
        "_ingress",
        "_buffered",
        "peer",
        "_make_core",
        "_turns",
        "protocol",
        "_writing_paused",
        "_backlogged",
        "_slicing",
        "_closing_since",
    )

    def __init__(
        self,
        state: ServerState,
        limits: ConnectionLimits,
        turns: TurnQueue,
        make_core: CoreFactory = ndjson_core,
        protocol: str = "ndjson",
    ) -> None:
        self._state = state
        self.limits = limits
        self._make_core = make_core
        self._turns = turns  # shared by every connection of the loop
        self.protocol = protocol  # the front door: "ndjson" or "http"
        self._transport: asyncio.Transport | None = None
        self._ingress: ClientCore | None = None
        self._buffered = 0  # this connection's share of state.buffered_bytes
        self.peer: object = None  # the socket's peername (the front door trusts gateways by it)
        # Reading stops while the client does not read (writing paused) or, on HTTP, while as many
        # requests as may be pipelined wait: it resumes only when neither holds.
        self._writing_paused = False
        self._backlogged = False
        self._slicing = False  # the core holds frames of a read back for later turns of the loop
        self._closing_since: float | None = None  # closed gracefully, its last bytes not yet out

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.peer = transport.get_extra_info("peername")
        state = self._state
        self._ingress = self._make_core(state, self._transport.write, self)  # it words the refusal below
        if len(state.connections) >= self.limits.max_connections:
            n = self.limits.max_connections
            self.shed(
                ShedReason.MAX_CONNECTIONS, TooManyConnections(f"the governor holds its limit of {n} connections")
            )
            self._ingress = None
            return
        state.connections.add(self)

    def data_received(self, data: bytes) -> None:
        ingress = self._ingress
        if ingress is not None:
            self._step(ingress, False, ingress.receive_data, data)

    def next_slice(self, budget: int) -> tuple[int, bool]:
        """The turn queue's call (doors/turns.py): the core answers up to `budget` frames it held."""
        ingress, transport = self._ingress, self._transport
        if ingress is None or transport is None or transport.is_closing() or not self._slicing:
            self._slicing = False
            return 0, False
        held = ingress.held_frames
        self._step(ingress, True, ingress.resume, budget)
        return held - ingress.held_frames, self._slicing

    def _step(self, ingress: ClientCore, chained: bool, step: Callable[..., None], *args: bytes | int) -> None:
        """Run one step of the core (a read, or with `chained` a slice of the frames it held) and
        act on what it left: frames held for later turns, a connection to shed, bytes it buffers."""
        transport = self._transport
        if transport is None:
            return  # refused or shed; the transport is closing
        try:
            step(*args)
        except Exception:
            # A bug of ours must cost this one connection, never the server.
            log.exception("event=internal_error where=%s", "next_slice" if chained else "data_received")
            ingress.fail_internal()
            transport.close()
            self._slicing = False
            return
        more = ingress.held_frames > 0
        if more != self._slicing:
            self._slicing = more
            if more and not chained:  # (a chained step is already in the queue)
                self._turns.add(self)
            self._set_reading()
        if ingress.closing is not None:
            self.shed(ingress.closing)  # the refusal is written; close after it
            return
        buffered = ingress.buffered_bytes
        if buffered != self._buffered:
            state = self._state
            state.buffered_bytes += buffered - self._buffered
            self._buffered = buffered
            if state.buffered_bytes > self.limits.max_buffer_bytes:
                victim = max(state.connections, key=lambda c: c.buffered_bytes)
                limit = self.limits.max_buffer_bytes
                victim.shed(
                    ShedReason.BUFFER, BufferFull(f"unfinished frames over all connections exceed {limit} bytes")
                )

    def eof_received(self) -> bool | None:
        # The client closed (or half-closed) its side: it is treated as gone. Its slots are freed and
        # its requests cancelled now, not when our side has flushed (a full write buffer can take
        # long); returning None then closes our side once the replies already written are out.
        # Frames it sent before closing that still wait for their slice are answered first.
        ingress = self._ingress
        if ingress is not None:
            while ingress.held_frames and ingress.closing is None:
                ingress.resume(FRAMES_PER_TURN)
            self._slicing = False  # (the queue drops it at its turn)
            ingress.connection_lost()
        return None

    def pause_writing(self) -> None:
        if self._transport is not None and self._ingress is not None:
            self._writing_paused = True
            self._set_reading()
            self._ingress.write = self._write_paused

    def resume_writing(self) -> None:
        if self._transport is not None and self._ingress is not None and not self._transport.is_closing():
            self._writing_paused = False
            self._ingress.write = self._transport.write
            self._set_reading()

    def _set_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._writing_paused or self._backlogged or self._slicing:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _write_paused(self, data: bytes) -> None:
        """Replies to in-flight requests of a client that is not reading: bounded, then cut."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if transport.get_write_buffer_size() > self.limits.max_write_buffer_bytes:
            # Deferred: this runs inside the ingress's own flush, which shedding would re-enter.
            asyncio.get_running_loop().call_soon(self.shed, ShedReason.WRITE_BUFFER)

    def check_timeouts(self, now: float) -> None:
        """Called about once a second: the core says whether the connection overstayed (an auth
        deadline, an idle connection, a request arriving too slowly); a graceful close whose last
        bytes the client does not take within the idle timeout (or a minute) is cut."""
        if self._closing_since is not None:
            if self._transport is not None and now - self._closing_since > (self.limits.idle_timeout_s or 60.0):
                self._transport.abort()
            return
        if self._ingress is not None:
            expired = self._ingress.timeout(now, self.limits.idle_timeout_s)
            if expired is not None:
                self.shed(*expired)

    def pause_reading(self, paused: bool) -> None:
        """The core holds as many requests as it may (HTTP pipelining): stop reading until it drains."""
        self._backlogged = paused
        self._set_reading()

    def finish(self, reason: ShedReason | None) -> None:
        """The core is done with the connection: shed it for `reason`, or (None: the client asked to
        close after its response) close once the written bytes are out. It stays among the
        connections, under their limits, until it is gone."""
        if reason is not None:
            self.shed(reason, graceful=True)
        elif self._transport is not None and self._closing_since is None:
            self._closing_since = self._state.clock()
            self._transport.close()

    def shed(self, reason: ShedReason, error: GovernorError | None = None, graceful: bool = False) -> None:
        """Close this connection to protect the others: its requests are settled now (cancelled in
        the worker), and `error`, if given, is its last reply. `graceful` (a refusal the core has
        written, e.g. an HTTP 400): its bytes are flushed first, the close cut only if the client
        does not take them (check_timeouts)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        state = self._state
        state.accounting.connection_shed(reason)
        ingress = self._ingress
        inflight = 0 if ingress is None else len(ingress.active)
        tenant = None if ingress is None else ingress.tenant
        log.warning(
            "event=connection_shed reason=%s protocol=%s peer=%s tenant=%s inflight=%d",
            reason,
            self.protocol,
            peer_text(self.peer),
            tenant,
            inflight,
        )
        if ingress is not None:
            ingress.connection_lost(CONNECTION_SHED)
        self._release_buffer()
        if error is not None and ingress is not None:
            transport.write(ingress.last_words(error))
        if graceful:
            self._closing_since = state.clock()  # still swept until gone: check_timeouts cuts it
            transport.close()
            return
        state.connections.discard(self)
        if transport.get_write_buffer_size():
            transport.abort()  # a peer that is not reading would hold a graceful close open
        else:
            transport.close()

    def _release_buffer(self) -> None:
        self._state.buffered_bytes -= self._buffered
        self._buffered = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._state.connections.discard(self)
        self._release_buffer()
        if self._ingress is not None:
            self._ingress.connection_lost()
        self._transport = None

    @property
    def ingress(self) -> ClientCore | None:
        return self._ingress

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    @property
    def held_frames(self) -> int:
        """Frames the core holds for later turns (the turn queue's measure of its next slice)."""
        return 0 if self._ingress is None else self._ingress.held_frames

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def peer_text(peer: object) -> str:
    """A socket's peer as one token: `HOST:PORT` (`[HOST]:PORT` for IPv6), a Unix socket's path,
    or `-` when unknown. (Its peername is a tuple, which logged as `('127.0.0.1', 52744)`.)"""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(Address(host=str(peer[0]), port=int(peer[1])))
    return str(peer) if peer else "-"
