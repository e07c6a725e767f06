"""asyncio transport adapter: moves bytes between a client socket and its `Ingress`."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from governor.ingress import Ingress
from governor.state import ServerState

log = logging.getLogger("governor.protocol")


class GovernorProtocol(asyncio.Protocol):
    """Also the write-side flow control: a client that does not read its replies stops being read
    (its socket buffer fills, the transport calls `pause_writing`), so it cannot grow our memory."""

    __slots__ = ("_state", "_max_frame_bytes", "_transport", "_ingress")

    def __init__(self, state: ServerState, max_frame_bytes: int) -> None:
        self._state = state
        self._max_frame_bytes = max_frame_bytes
        self._transport: asyncio.Transport | None = None
        self._ingress: Ingress | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._ingress = Ingress(self._state, self._transport.write, self._max_frame_bytes)
        self._state.connections.add(self)

    def data_received(self, data: bytes) -> None:
        assert self._ingress is not None and self._transport is not None  # set in connection_made
        try:
            self._ingress.receive_data(data)
        except Exception:
            # A bug of ours must cost this one connection, never the server.
            log.exception("event=internal_error where=data_received")
            self._ingress.fail_internal()
            self._transport.close()

    def eof_received(self) -> bool | None:
        # The client closed (or half-closed) its side: it is treated as gone. Its slots are freed and
        # its requests cancelled now, not when our side has flushed (a full write buffer can take
        # long); returning None then closes our side once the replies already written are out.
        if self._ingress is not None:
            self._ingress.connection_lost()
        return None

    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._state.connections.discard(self)
        if self._ingress is not None:
            self._ingress.connection_lost()

    @property
    def ingress(self) -> Ingress | None:
        return self._ingress

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
