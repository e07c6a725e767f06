"""A scripted HTTP/1.1 server on loopback for the link's tests: each request it reads (head and
`content-length` body) is handed to the test's async `respond(request, writer)`, which writes
whatever bytes the test wants — a well-formed stream, garbage, a cut, silence."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int  # which connection it came on, counted from 0


Respond = Callable[[Received, asyncio.StreamWriter], Awaitable[bool | None]]
"""Writes the response; returns False to close the connection afterwards."""


@dataclass
class ScriptedServer:
    respond: Respond
    received: list[Received] = field(default_factory=list)
    connections: int = 0
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)  # a client closed on us
    port: int = 0
    _server: asyncio.Server | None = None

    async def start(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = Received(method, path, headers, body, number)
                self.received.append(request)
                keep = await self.respond(request, writer)
                await writer.drain()
                if keep is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnected.set()
        except asyncio.CancelledError:  # the test's loop is closing: this handler ends with it
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


def sse_response(*events: str, chunked: bool = True, status: str = "200 OK") -> bytes:
    """A streamed completion response, chunked one event per chunk (or sized)."""
    payloads = [b"data: " + e.encode() + b"\n\n" for e in events]
    if not chunked:
        body = b"".join(payloads)
        return b"HTTP/1.1 %s\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (
            status.encode(),
            len(body),
            body,
        )
    head = b"HTTP/1.1 %s\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" % status.encode()
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\n\r\n"


def plain_response(status: str, body: bytes = b"", headers: str = "") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status.encode(), len(body), headers.encode(), body)
