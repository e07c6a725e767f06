"""asyncio transport adapter: moves bytes between a client socket and its `Ingress`."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from governor.errors import InternalError
from governor.ingress import Ingress
from governor.state import ServerState
from governor.wire import encode_error

log = logging.getLogger("governor.protocol")


class GovernorProtocol(asyncio.Protocol):
    __slots__ = ("_state", "_max_frame_bytes", "_transport", "_ingress", "_read_closed")

    def __init__(self, state: ServerState, max_frame_bytes: int) -> None:
        self._state = state
        self._max_frame_bytes = max_frame_bytes
        self._transport: asyncio.Transport | None = None
        self._ingress: Ingress | None = None
        self._read_closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._ingress = Ingress(self._state, self._send, self._max_frame_bytes)
        self._state.connections.add(self)

    def _send(self, data: bytes) -> None:
        assert self._transport is not None and self._ingress is not None
        self._transport.write(data)
        if self._read_closed and not self._ingress.active:
            self._transport.close()  # a half-closed client has its last final reply: done

    def data_received(self, data: bytes) -> None:
        assert self._ingress is not None and self._transport is not None  # set in connection_made
        try:
            self._ingress.receive_data(data)
        except Exception:
            # A bug of ours must cost this one connection, never the server.
            log.exception("event=internal_error where=data_received")
            self._transport.write(encode_error(InternalError("internal error; closing connection")))
            self._transport.close()

    def eof_received(self) -> bool | None:
        # A client may half-close after its last frame and still read the replies: keep writing
        # until its requests are settled. With nothing in flight, close at once.
        if self._ingress is not None and self._ingress.active:
            self._read_closed = True
            return True
        return None

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
