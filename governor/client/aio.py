"""The asyncio client: the same arguments and behaviour as `Client`, for use inside an event loop.

Any number of tasks may share one `AsyncClient`: a single reader routes replies to the request
they belong to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from governor.client.retry import Retries, RetryPolicy, Yielded
from governor.client.session import (
    FINAL,
    ConnectionLost,
    Event,
    Result,
    Session,
    Token,
    identity,
    refusal,
    request_ids,
)
from governor.client.where import client_address
from govwire.address import open_connection
from govwire.auth import SharedSecret
from govwire.errors import GovernorError, InternalError
from govwire.vocab import Op, ReservedId, Status

Reply = Event | dict[str, Any] | ConnectionLost
Route = Callable[[Reply, float], None]  # a reply and the time.monotonic() of the read that brought it


class AsyncStream:
    """Tokens of one request as they arrive; `result` once the last one was read. Leaving early
    (`break` inside `async with`, `aclose()`, cancellation of the reading task) cancels it."""

    def __init__(self, tokens: AsyncGenerator[Token | Result, None]) -> None:
        self._tokens = tokens
        self.result: Result | None = None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Token:
        item = await self._tokens.__anext__()
        if isinstance(item, Result):
            self.result = item
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        await self._tokens.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Link(asyncio.Protocol):
    """One connection of the client. Callbacks of a connection the client has already replaced
    (a late `connection_lost` after a reconnect) are ignored."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        if self._client._link is self:
            self._client._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client._link is self:
            self._client._lost(exc)


class AsyncClient:
    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        token: str | None = None,
        timeout: float | None = 60.0,
        connect_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        address: str | None = None,
    ) -> None:
        """Connects on first use (or `await client.connect()`), and again after a loss. `address`
        (`HOST:PORT` or `unix:PATH`, e.g. a worker's socket) replaces host and port; given none of
        them, `$GOVERNOR_ADDRESS` or 127.0.0.1:7070."""
        self._address = client_address(host, port, address)
        self.host, self.port = self._address.host, self._address.port  # "" and 0 for a unix socket
        self._where = str(self._address)
        self._secret = None if token is None else SharedSecret.from_text(token, "token")
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._retries = Retries(retry)
        self._transport: asyncio.Transport | None = None
        self._link: _Link | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = request_ids()
        self._session = Session(self._ids)
        self._routes: dict[str, Route] = {}

    # -- requests -------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 16,
        tenant: str | None = None,
        priority: str | None = None,
        **sampling: Any,
    ) -> Result:
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, tenant=tenant, priority=priority, **sampling)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 16,
        tenant: str | None = None,
        priority: str | None = None,
        retry_ticket: str | None = None,
        **sampling: Any,
    ) -> AsyncStream:
        """Stream a generate's tokens, then its `Result`; `retry_ticket`: the ticket of a yield this
        request retries (the client sends its own retries' tickets itself)."""
        fields = {"max_new_tokens": max_new_tokens, "stream": True, **identity(tenant, priority), **sampling}
        return AsyncStream(self._tokens(prompt, fields, retry_ticket))

    def submit(
        self,
        prompt: str,
        on_event: Route,
        *,
        tenant: str | None = None,
        priority: str | None = None,
        retry_ticket: str | None = None,
        **fields: Any,
    ) -> str:
        """Send a generate now, without waiting or retrying, and pass each of its events to
        `on_event` as it is read: for harnesses that time every reply (`governor bench`). The
        client must be connected; a retry of a yielded request passes the yield's `retry_ticket`.
        Returns the request id."""
        rid, frame = self._session.generate(prompt, {**identity(tenant, priority), **fields}, retry_ticket)
        self._routes[rid] = on_event
        try:
            self._write(frame)
        except ConnectionLost:
            self._abandon(rid)
            raise
        return rid

    async def ping(self) -> dict[str, Any]:
        return await self._control(Op.PING)

    async def stats(self) -> dict[str, Any]:
        return await self._control(Op.STATS)

    async def connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._transport is None:
                await self._open()

    async def aclose(self) -> None:
        """Close the connection; requests still in flight on it get `ConnectionLost`."""
        if self._transport is not None:
            self._transport.close()
        self._lost(None)

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals ------------------------------------------------------------------------------------

    async def _tokens(
        self, prompt: str, fields: dict[str, Any], ticket: str | None = None
    ) -> AsyncGenerator[Token | Result, None]:
        attempts = self._retries.start()
        while True:
            await self.connect()
            rid, frame = self._session.generate(prompt, fields, ticket)
            queue = self._queue(rid)
            started = False
            try:
                self._write(frame)
                while True:
                    event = await self._next(queue)
                    if isinstance(event, Token):
                        started = True
                        yield event
                    elif isinstance(event, Result):
                        yield event
                        return
                    elif isinstance(event, Yielded | GovernorError):
                        raise event
            except (Yielded, GovernorError) as failure:
                wait_s = None if started else attempts.wait_s(failure)
                if wait_s is None:
                    raise
                ticket = failure.retry_ticket if isinstance(failure, Yielded) else None
                await asyncio.sleep(wait_s)
            finally:
                self._abandon(rid)

    async def _control(self, op: str) -> dict[str, Any]:
        await self.connect()
        rid, frame = self._session.control(op)
        queue = self._queue(rid)
        try:
            self._write(frame)
            reply = await self._next(queue)
        finally:
            self._routes.pop(rid, None)
        if isinstance(reply, GovernorError):
            raise reply  # e.g. unauthorized: the governor closes the connection after it
        if not isinstance(reply, dict):  # a peer that is not a governor answered something else
            raise InternalError(f"{op}: not a {op} reply but {type(reply).__name__}")
        return reply

    def _queue(self, rid: str) -> asyncio.Queue[Reply]:
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._routes[rid] = lambda reply, _: queue.put_nowait(reply)
        return queue

    def _abandon(self, rid: str) -> None:
        self._routes.pop(rid, None)
        if rid in self._session.open:
            frame = self._session.cancel(rid)
            if self._transport is not None:
                self._transport.write(frame)

    async def _next(self, queue: asyncio.Queue[Reply]) -> Event | dict[str, Any]:
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that lands
            # as the reply arrives, and a cancelled stream would then run to its end.
            async with asyncio.timeout(self._timeout):
                reply = await queue.get()
        except TimeoutError:
            raise TimeoutError(f"no reply from {self._where} within {self._timeout} s") from None
        if isinstance(reply, ConnectionLost):
            raise reply
        return reply

    def _write(self, frame: bytes) -> None:
        if self._transport is None:
            raise ConnectionLost(f"connection to {self._where} lost")
        self._transport.write(frame)

    def _received(self, data: bytes) -> None:
        now = time.monotonic()
        session = self._session
        for rid, event in session.feed(data):
            route = self._routes.get(rid)
            if route is not None:
                if isinstance(event, FINAL):
                    del self._routes[rid]
                route(event, now)
        if session.broken is not None:
            if self._transport is not None:
                self._transport.abort()
            self._lost(session.broken)

    def _lost(self, exc: Exception | None) -> None:
        """The connection is gone (or closed by us): fail what is in flight on it."""
        self._transport = self._link = None
        self._session = Session(self._ids)
        lost = ConnectionLost(f"connection to {self._where} lost" + (f": {exc}" if exc else ""))
        routes, self._routes = self._routes, {}
        now = time.monotonic()
        for route in routes.values():
            route(lost, now)

    async def _open(self) -> None:
        link = _Link(self)
        self._link = link
        async with asyncio.timeout(self._connect_timeout):
            self._transport = await open_connection(self._address, lambda: link)
        self._session = Session(self._ids)
        if self._secret is not None:
            queue = self._queue(ReservedId.AUTH)
            try:
                self._write(self._session.auth_frame(self._secret))
                reply = cast(dict[str, Any], await self._next(queue))
            except ConnectionLost as exc:
                raise PermissionError(f"{self._where} refused the token") from exc
            finally:
                self._routes.pop(ReservedId.AUTH, None)
            if reply.get("status") != Status.AUTHENTICATED:
                await self.aclose()
                raise refusal(reply, self._where)
