"""A small HTTP/1.1 client for one upstream server: keep-alive connections as asyncio protocols,
responses parsed by httptools (llhttp, the parser of the front door and of uvicorn).

Why not httpx or aiohttp: relaying a short streamed completion through httpx (httpcore, h11,
httpx-sse) cost the governor ~1.2 ms of CPU per request and ~18 µs per token, ~80× nginx's
proxy_pass in front of the same server (docs/benchmarks/sittings.md §13 measures the three side by side).
Here a request is one `transport.write` on a pooled connection and its response is handed to its
handler by the parser's callbacks, one `read_done` per read so that whoever renders it writes
once per read. It does only what the OpenAI-compatible link needs: requests whose bytes the
caller formats (`request_head`), responses streamed to a handler, keep-alive reuse, a connect
timeout, a stall timeout (no byte for that long) and abort (closing the connection is how a
server learns a client is gone).

A response ends by its length, its chunked encoding or, with neither, the server closing the
connection; a connection goes back to the pool when its response ended and both sides keep it
alive. A request sent on a reused connection that the server closed before answering a byte (the
server's keep-alive timeout racing our write) is sent again once on a new connection: the server
never read it.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Protocol, cast

import httptools

MAX_HEADER_BYTES = 64 * 1024  # of a response's head: an endless head is a broken server


class HttpClientError(Exception):
    """The exchange failed before its response ended."""


class ConnectFailed(HttpClientError):
    """No connection could be made (refused, unreachable)."""


class ConnectTimeout(HttpClientError):
    """The connection was not made within the connect timeout."""


class StallTimeout(HttpClientError):
    """The server sent nothing for the stall timeout while a response was awaited or streaming."""


class ConnectionBroken(HttpClientError):
    """The connection closed or broke before the response ended."""


class MalformedResponse(HttpClientError):
    """The server's bytes are not an HTTP/1.1 response (or its head is too large)."""


class ResponseHandler(Protocol):
    """Where a response goes, as it arrives. Exactly one of `response_end` and `response_failed`
    is called, after `response_head` (unless the exchange failed before the head); `read_done`
    after each read that called any of them, so the handler can flush once per read. A handler
    must not raise."""

    def response_head(self, status: int, headers: dict[bytes, bytes]) -> None: ...

    def response_body(self, data: bytes) -> None: ...

    def response_end(self) -> None: ...

    def response_failed(self, error: HttpClientError) -> None: ...

    def read_done(self) -> None: ...


def request_head(method: bytes, target: bytes, host: bytes, headers: bytes, body_length: int | None) -> bytes:
    """A request's head; `headers` are whole `name: value\\r\\n` lines."""
    length = b"" if body_length is None else b"content-length: %d\r\n" % body_length
    return b"%s %s HTTP/1.1\r\nhost: %s\r\n%s%s\r\n" % (method, target, host, headers, length)


class HttpPool:
    """The keep-alive connections to one server (host, port). Unbounded: the governor's caps
    bound how many requests are in flight, and a request never waits for a connection."""

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout_s: float,
        stall_timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls  # https: the context its connections are wrapped in
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._idle: dict[HttpConnection, None] = {}  # an ordered set: the most recent is reused first
        self._all: set[HttpConnection] = set()

    def start(self, payload: bytes, handler: ResponseHandler, stall_timeout_s: float | None = None) -> Call:
        """Send one request (head and body, formatted) and stream its response to `handler`:
        at once on an idle connection, else once a new one is made."""
        call = Call(self, payload, handler, self.stall_timeout_s if stall_timeout_s is None else stall_timeout_s)
        call.send()
        return call

    # -- its calls' and connections' side ----------------------------------------------------------

    def take_idle(self) -> HttpConnection | None:
        """The most recently released connection still open, if any (Call.send)."""
        while self._idle:
            connection, _ = self._idle.popitem()
            if not connection.closed:
                return connection
        return None

    async def connect(self) -> HttpConnection:
        """A new connection (Call); `ConnectTimeout` or `ConnectFailed` when none is made."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: HttpConnection(self),
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls is not None else None,
                )
        except TimeoutError:
            where, within = f"{self.host}:{self.port}", self.connect_timeout_s
            raise ConnectTimeout(f"no connection to {where} within {within:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{self.host}:{self.port}: {exc.strerror or exc}") from None
        return connection

    def opened(self, connection: HttpConnection) -> None:
        """A connection is made: `close` aborts it until it is lost."""
        self._all.add(connection)

    def release(self, connection: HttpConnection) -> None:
        """Its response ended and both sides keep it alive: the next request may take it."""
        self._idle[connection] = None

    def withdraw(self, connection: HttpConnection) -> None:
        """It is closing: no request takes it."""
        self._idle.pop(connection, None)

    def forget(self, connection: HttpConnection) -> None:
        """It is lost."""
        self._idle.pop(connection, None)
        self._all.discard(connection)

    def close(self) -> None:
        """Close every connection; exchanges under way fail (`ConnectionBroken`)."""
        for connection in list(self._all):
            connection.abort()
        self._idle.clear()


class Call:
    """One request and its response: sent on a connection, retried once on a new one when a
    reused connection turns out closed before a byte of the answer, aborted by `abort`."""

    __slots__ = ("_aborted", "_connection", "_handler", "_payload", "_pool", "_retried", "_stall_s", "_task")

    def __init__(self, pool: HttpPool, payload: bytes, handler: ResponseHandler, stall_s: float) -> None:
        self._pool = pool
        self._payload = payload
        self._handler = handler
        self._stall_s = stall_s
        self._connection: HttpConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._retried = False
        self._aborted = False

    def send(self) -> None:
        connection = self._pool.take_idle()
        if connection is not None:
            self._connection = connection
            connection.send(self._payload, self._handler, self, self._stall_s)
        else:
            self._task = asyncio.get_running_loop().create_task(self._send_new())

    async def _send_new(self) -> None:
        try:
            connection = await self._pool.connect()
        except HttpClientError as exc:
            self._task = None
            self._handler.response_failed(exc)
            self._handler.read_done()
            return
        self._task = None
        if self._aborted:
            connection.abort()
            return
        self._connection = connection
        connection.send(self._payload, self._handler, self, self._stall_s)

    def failed(self, connection: HttpConnection, error: HttpClientError, answered: bool) -> bool:
        """The connection broke under this call: True when the call goes on (sent again)."""
        self._connection = None
        if answered or not connection.reused or self._retried or self._aborted or type(error) is not ConnectionBroken:
            return False
        self._retried = True
        self._task = asyncio.get_running_loop().create_task(self._send_new())
        return True

    def abort(self) -> None:
        """Stop the exchange: its connection is closed (the server sees the client gone) and the
        handler hears nothing more."""
        self._aborted = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.abort()


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time (no pipelining)."""

    def __init__(self, pool: HttpPool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._handler: ResponseHandler | None = None
        self._call: Call | None = None
        self._headers: dict[bytes, bytes] = {}
        self._header_bytes = 0
        self._informational = False  # a 1xx before the real response
        self._until_eof = False  # a response with neither length nor chunking: it ends at close
        self._answered = False  # a byte of the response came
        self._stall_s = 0.0
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.reused = False
        self.closed = False

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not an asyncio.Transport)
        self._pool.opened(self)

    def data_received(self, data: bytes) -> None:
        handler = self._handler
        if handler is None:
            self.abort()  # bytes nobody asked for: the connection is not in a state to reuse
            return
        self._answered = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(MalformedResponse("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(MalformedResponse(f"malformed HTTP response: {exc}"))
        handler.read_done()

    def eof_received(self) -> bool:
        return False  # close: a half-closed server sends nothing more

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        handler = self._handler
        if handler is None:
            return
        if self._until_eof:
            self._complete(keep_alive=False)
        else:
            why = f": {exc}" if exc is not None else ""
            self._fail(ConnectionBroken(f"the server closed the connection before the response ended{why}"))
        handler.read_done()

    # -- the exchange -------------------------------------------------------------------------------

    def send(self, payload: bytes, handler: ResponseHandler, call: Call, stall_s: float) -> None:
        assert self._transport is not None
        self._handler, self._call = handler, call
        self._headers = {}
        self._header_bytes = 0
        self._answered = self._informational = self._until_eof = False
        self._stall_s = stall_s
        self._last_read = self._loop.time()
        self._timer = self._loop.call_later(stall_s, self._check_stall)
        self._transport.write(payload)

    def _check_stall(self) -> None:
        self._timer = None
        if self._handler is None:
            return
        silent = self._loop.time() - self._last_read
        if silent < self._stall_s * 0.999:
            self._timer = self._loop.call_later(self._stall_s - silent, self._check_stall)
            return
        handler = self._handler
        self._fail(StallTimeout(f"no byte from the server for {self._stall_s:g} s"))
        handler.read_done()

    def _fail(self, error: HttpClientError) -> None:
        handler, call = self._handler, self._call
        self._detach()
        self.abort()
        if handler is None:
            return
        if call is not None and call.failed(self, error, self._answered):
            return
        handler.response_failed(error)

    def _complete(self, keep_alive: bool) -> None:
        handler = self._handler
        self._detach()
        if keep_alive and not self.closed:
            self.reused = True
            self._pool.release(self)
        else:
            self.abort()
        if handler is not None:
            handler.response_end()

    def _detach(self) -> None:
        self._handler = self._call = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def abort(self) -> None:
        self._detach()
        if not self.closed:
            self.closed = True
            self._pool.withdraw(self)
            if self._transport is not None:
                self._transport.abort()

    # -- httptools callbacks (called inside feed_data) ------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise httptools.HttpParserError(f"the response head exceeds {MAX_HEADER_BYTES} bytes")
        key = name.lower()
        previous = self._headers.get(key)
        self._headers[key] = value if previous is None else previous + b", " + value

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the response follows
            self._informational = True
            self._headers = {}
            return
        headers = self._headers
        self._until_eof = (
            b"content-length" not in headers and b"transfer-encoding" not in headers and status not in (204, 304)
        )
        if self._handler is not None:
            self._handler.response_head(status, headers)

    def on_body(self, body: bytes) -> None:
        if self._handler is not None:
            self._handler.response_body(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self._until_eof = False
        self._complete(self._parser.should_keep_alive())
