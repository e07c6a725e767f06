"""The blocking client: one persistent connection, pipelined requests, retries that honour hints.

Not thread-safe (like `http.client`): use one `Client` per thread. Streams may be interleaved
within a thread; replies for the others are kept until they are read.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Generator
from typing import Any, cast

from governor.client.retry import Retries, RetryPolicy, Yielded
from governor.client.session import (
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
from govwire.auth import SharedSecret
from govwire.errors import GovernorError, InternalError
from govwire.vocab import Op, ReservedId, Status

Reply = Event | dict[str, Any] | ConnectionLost


class Stream:
    """Tokens of one request as they arrive; `result` once the last one was read. Leaving it early
    cancels the request on the server: `close()`, or leaving a `with` block (by `break` or an
    exception), or dropping the last reference to it after a `break`."""

    def __init__(self, tokens: Generator[Token, None, Result]) -> None:
        self._tokens = tokens
        self.result: Result | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Token:
        try:
            return next(self._tokens)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def close(self) -> None:
        self._tokens.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
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
        """`timeout` bounds each wait for a reply (None: wait forever). Without `retry` every yield
        is raised as `Yielded`; with a `RetryPolicy` yields are retried after their hint. The
        connection opens here and is reopened by the next call after a loss. `address`
        (`HOST:PORT` or `unix:PATH`) replaces host and port, as for AsyncClient; given none of
        them, `$GOVERNOR_ADDRESS` or 127.0.0.1:7070."""
        self._address = client_address(host, port, address)
        self.host, self.port = self._address.host, self._address.port  # "" and 0 for a unix socket
        self._where = str(self._address)
        self._secret = None if token is None else SharedSecret.from_text(token, "token")
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._retries = Retries(retry)
        self._sock: socket.socket | None = None
        self._ids = request_ids()
        self._session = Session(self._ids)
        self._queues: dict[str, deque[Reply]] = {}
        self._connect()

    # -- requests -------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 16,
        tenant: str | None = None,
        priority: str | None = None,
        **sampling: Any,
    ) -> Result:
        """The finished completion. Raises `Yielded` (once retries are spent), a `GovernorError`
        subclass per error code, `ConnectionLost` or `TimeoutError`. `tenant` and `priority`
        (critical, standard, sheddable) go in the frame only when given."""
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, tenant=tenant, priority=priority, **sampling)
        for _ in stream:
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
        **sampling: Any,
    ) -> Stream:
        """Tokens as they are generated. Retries (on a yield or `worker_unavailable`) happen before
        the first token, so a stream never repeats itself."""
        fields = {"max_new_tokens": max_new_tokens, "stream": True, **identity(tenant, priority), **sampling}
        return Stream(self._tokens(prompt, fields))

    def ping(self) -> dict[str, Any]:
        return self._control(Op.PING)

    def stats(self) -> dict[str, Any]:
        return self._control(Op.STATS)

    def close(self) -> None:
        """Close the connection; streams still open on it raise `ConnectionLost`."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        lost = ConnectionLost(f"connection to {self._where} closed")
        for queue in self._queues.values():
            queue.append(lost)
        self._session = Session(self._ids)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------

    def _tokens(self, prompt: str, fields: dict[str, Any]) -> Generator[Token, None, Result]:
        attempts = self._retries.start()
        ticket: str | None = None
        while True:
            rid = self._send_generate(prompt, fields, ticket)
            started = False
            try:
                while True:
                    event = self._next(rid)
                    if isinstance(event, Token):
                        started = True
                        yield event
                    elif isinstance(event, Result):
                        return event
                    elif isinstance(event, Yielded | GovernorError):
                        raise event
            except (Yielded, GovernorError) as failure:
                wait_s = None if started else attempts.wait_s(failure)
                if wait_s is None:
                    raise
                ticket = failure.retry_ticket if isinstance(failure, Yielded) else None
                time.sleep(wait_s)
            finally:
                self._abandon(rid)

    def _send_generate(self, prompt: str, fields: dict[str, Any], retry_ticket: str | None) -> str:
        self._ensure_connected()
        rid, frame = self._session.generate(prompt, fields, retry_ticket)
        self._queues[rid] = deque()
        self._send(frame)
        return rid

    def _control(self, op: str) -> dict[str, Any]:
        self._ensure_connected()
        rid, frame = self._session.control(op)
        self._queues[rid] = deque()
        try:
            self._send(frame)
            reply = self._next(rid)
        finally:
            self._queues.pop(rid, None)
        if isinstance(reply, GovernorError | ConnectionLost):
            raise reply  # e.g. unauthorized: the governor closes the connection after it
        if not isinstance(reply, dict):  # a peer that is not a governor answered something else
            raise InternalError(f"{op}: not a {op} reply but {type(reply).__name__}")
        return reply

    def _abandon(self, rid: str) -> None:
        """Done with `rid`: if it may still run (left early, timed out), cancel it on the server."""
        self._queues.pop(rid, None)
        if rid in self._session.open:
            frame = self._session.cancel(rid)
            if self._sock is not None:
                try:
                    self._send(frame)
                except OSError:
                    pass  # the connection is gone: the governor cancels on its own

    def _next(self, rid: str) -> Event | dict[str, Any]:
        queue = self._queues[rid]
        while not queue:
            self._read()
        reply = queue.popleft()
        if isinstance(reply, ConnectionLost):
            raise reply
        return reply

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            raise TimeoutError(f"no reply from {self._where} within {self._timeout} s") from None
        except OSError as exc:
            self._lost()
            raise ConnectionLost(f"connection to {self._where} failed: {exc}") from exc
        if not data:
            self._lost()
            raise ConnectionLost(f"{self._where} closed the connection")
        session = self._session
        for rid, event in session.feed(data):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.append(event)
        if session.broken is not None:
            self._lost()
            raise session.broken

    def _send(self, frame: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            self._lost()
            raise ConnectionLost(f"connection to {self._where} failed: {exc}") from exc

    def _lost(self) -> None:
        self.close()

    def _ensure_connected(self) -> None:
        if self._sock is None:
            self._connect()

    def _connect(self) -> None:
        if self._address.is_unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._connect_timeout)
            try:
                sock.connect(self._address.path)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self._address.host, self._address.port), timeout=self._connect_timeout)
        sock.settimeout(self._timeout)
        self._sock = sock
        if self._secret is not None:
            self._queues[ReservedId.AUTH] = deque()
            try:
                self._send(self._session.auth_frame(self._secret))
                reply = cast(dict[str, Any], self._next(ReservedId.AUTH))
            except ConnectionLost as exc:
                raise PermissionError(f"{self._where} refused the token") from exc
            finally:
                self._queues.pop(ReservedId.AUTH, None)
            if reply.get("status") != Status.AUTHENTICATED:
                self.close()
                raise refusal(reply, self._where)
