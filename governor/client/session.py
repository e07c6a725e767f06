"""The client side of one connection, without I/O: frames out, replies routed to their requests.

Both `Client` and `AsyncClient` wrap a `Session`. It assigns request ids, turns replies into
`Token`s, a `Result` or a typed exception, and attributes the replies that carry `id: null` (a
frame the governor could not read, or a connection-level error before a close): every generate
is sent with `ack` (and ping and stats are answered at once), so each frame's first reply comes
back in the order frames were sent, and an id-less reply belongs to the oldest request still
waiting for its first one.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from governor.client.retry import Yielded
from govwire.auth import SharedSecret
from govwire.codec import encode, generate_frame
from govwire.errors import GovernorError, error_from_code
from govwire.framing import TOO_LARGE, LineSplitter
from govwire.vocab import MAX_REPLY_BYTES, Op, ReservedId, Status


class ConnectionLost(ConnectionError):
    """The connection ended while this request was in flight: it may or may not have run."""


@dataclass(frozen=True, slots=True)
class Token:
    index: int
    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class Result:
    """A finished request (`done`). `reply` is the whole frame, timings included."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reply: dict[str, Any] = field(repr=False)

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> Result:
        return cls(
            reply.get("text", ""),
            reply.get("finish_reason", ""),
            reply.get("prompt_tokens", 0),
            reply.get("completion_tokens", 0),
            reply,
        )


@dataclass(frozen=True, slots=True)
class Accepted:
    """The governor admitted the request and handed it to a worker (the `ack` reply)."""


ACCEPTED = Accepted()
Event = Accepted | Token | Result | Yielded | GovernorError  # what a request's replies turn into


def event_of(reply: dict[str, Any]) -> Event | None:
    """The meaning of one reply for its request; None for those that only acknowledge."""
    status = reply.get("status")
    if status == Status.TOKEN:
        return Token(reply.get("index", 0), reply.get("token_id", 0), reply.get("text", ""))
    if status == Status.DONE:
        return Result.from_reply(reply)
    if status == Status.YIELD:
        ticket = reply.get("retry_ticket")
        return Yielded(
            str(reply.get("id")),
            int(reply.get("retry_hint_ms", 0)),
            str(reply.get("reason")),
            ticket if type(ticket) is str else None,
            reply.get("final") is True,
        )
    if status == Status.ERROR:
        return error_from_code(str(reply.get("code")), str(reply.get("message", "")), reply.get("id"))
    if status == Status.ACCEPTED:
        return ACCEPTED
    return None  # control answers (pong, stats, authenticated)


FINAL = (Result, Yielded, GovernorError)


RESERVED_FIELDS = frozenset({"id", "op", "prompt", "size", "sha256", "ack", "integrity", "retry_ticket"})


def identity(tenant: str | None, priority: str | None) -> dict[str, str]:
    """The frame fields naming a request's tenant and class, only those given: a frame without
    them speaks for its connection's tenant at the standard class, so leaving them out keeps the
    frame what it was before the governor knew either."""
    return {k: v for k, v in (("tenant", tenant), ("priority", priority)) if v is not None}


class Session:
    """Request bookkeeping of one connection. `feed` returns (request id, event) pairs in order;
    control replies (ping, stats) come back as their raw dict.

    `ids` is shared by all sessions of one client, so an id is never reused after a reconnect:
    a request of an earlier connection can never be confused with a new one. A feed that meets a
    reply it cannot read sets `broken`: the events before it are returned, the connection is lost.
    """

    def __init__(self, ids: Iterator[str]) -> None:
        self._ids = ids
        self._splitter = LineSplitter(MAX_REPLY_BYTES)
        # Frames without a first reply yet, in send order, including ones given up on: an id-less
        # reply belongs to the head, whatever became of it.
        self._unacknowledged: deque[str] = deque()
        self.open: set[str] = set()  # ids that may still get replies we want
        self.broken: ConnectionLost | None = None

    def auth_frame(self, secret: SharedSecret) -> bytes:
        self._unacknowledged.append(ReservedId.AUTH)
        return encode({"id": ReservedId.AUTH, **secret.frame()})

    def generate(self, prompt: str, fields: dict[str, Any], retry_ticket: str | None = None) -> tuple[str, bytes]:
        """A generate frame; a retry sends back the ticket of the yield it follows."""
        reserved = RESERVED_FIELDS.intersection(fields)
        if reserved:
            raise TypeError(f"the client sets {', '.join(sorted(reserved))} itself")
        rid = next(self._ids)
        self._unacknowledged.append(rid)
        self.open.add(rid)
        if retry_ticket is not None:
            fields = {**fields, "retry_ticket": retry_ticket}
        return rid, encode(generate_frame(rid, prompt, ack=True, **fields))

    def control(self, op: str) -> tuple[str, bytes]:
        rid = next(self._ids)
        self._unacknowledged.append(rid)
        self.open.add(rid)
        return rid, encode({"id": rid, "op": op})

    def cancel(self, rid: str) -> bytes:
        """Stop listening to `rid` and ask the governor to stop it (it answers with the final reply,
        which is then dropped)."""
        self.open.discard(rid)
        return encode({"id": rid, "op": Op.CANCEL})

    def feed(self, data: bytes) -> list[tuple[str, Event | dict[str, Any]]]:
        out: list[tuple[str, Event | dict[str, Any]]] = []
        if self.broken is not None:
            return out
        for line in self._splitter.feed(data):
            if line is TOO_LARGE:
                self.broken = ConnectionLost(f"a reply exceeded {MAX_REPLY_BYTES} bytes")
                return out
            if not line:
                continue
            try:
                reply = orjson.loads(line)
            except orjson.JSONDecodeError:
                reply = None
            if type(reply) is not dict:
                # An HTTP answer: the address is the front door (--http-port), not the NDJSON port.
                http = line[:5] == b"HTTP/"
                hint = " (an HTTP server: the client speaks NDJSON to the governor's --port)" if http else ""
                self.broken = ConnectionLost(f"not a reply: {line[:200]!r}{hint}")
                return out
            rid = reply.get("id")
            status = reply.get("status")
            if rid is None and status == Status.ERROR and self._unacknowledged:
                rid = self._unacknowledged.popleft()  # the oldest frame still waiting for its first reply
            elif status != Status.TOKEN and type(rid) is str and rid in self._unacknowledged:
                self._unacknowledged.remove(rid)
            if rid == ReservedId.AUTH:
                out.append((ReservedId.AUTH, reply))
                continue
            if type(rid) is not str or rid not in self.open:
                continue  # a request given up on (cancelled, timed out), or a connection-level note
            event = event_of(reply)
            if event is None:
                if status != Status.AUTHENTICATED:
                    out.append((rid, reply))  # ping / stats answers
                    self.open.discard(rid)
                continue
            if isinstance(event, FINAL):
                self.open.discard(rid)
            out.append((rid, event))
        return out


def refusal(reply: dict[str, Any], where: str) -> Exception:
    """What a non-`authenticated` answer to the auth frame means: a wrong token, or (e.g.
    `too_many_connections`) a refusal that has nothing to do with it."""
    if reply.get("status") == Status.ERROR and reply.get("code") != "unauthorized":
        return error_from_code(str(reply.get("code")), str(reply.get("message", "")))
    return PermissionError(f"{where} refused the token: {reply.get('message', reply)}")


def request_ids() -> Iterator[str]:
    """One client's request ids, across all its connections."""
    return (f"c{n}" for n in itertools.count(1))
