"""The operator's HTTP endpoint: /metrics (Prometheus text), /healthz, /readyz.

Served on the event loop itself (not prometheus-client's thread server) so a scrape reads the
counters between callbacks, never halfway through one, and probes share one tiny server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

MAX_REQUEST_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, not_ready: Callable[[], str | None]) -> None:
        self._registry = registry
        self._not_ready = not_ready  # None when ready, else why not (the 503's body)
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_HEAD_BYTES)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        """Route one request: (status, content type, body)."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            why = self._not_ready()
            if why is None:
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", why.encode()
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) == 3:
                status, ctype, body = self.respond(parts[0], parts[1])
            else:
                status, ctype, body = 400, "text/plain", b"bad request\n"
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}.get(
                status, "Service Unavailable"
            )
            header = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(header if parts and parts[0] == "HEAD" else header + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
