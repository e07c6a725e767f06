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
from dataclasses import dataclass, field
from typing import Any

import orjson

from governor.auth import SharedSecret
from governor.client.retry import Yielded
from governor.errors import GovernorError, error_from_code
from governor.framing import TOO_LARGE, LineSplitter
from governor.validation import OP_CANCEL
from governor.wire import (
    STATUS_ACCEPTED,
    STATUS_AUTHENTICATED,
    STATUS_DONE,
    STATUS_ERROR,
    STATUS_TOKEN,
    STATUS_YIELD,
    encode,
    generate_frame,
)

MAX_REPLY_BYTES = 64 * 1024 * 1024  # a done frame carries the whole completion
AUTH_ID = "~auth"


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
    if status == STATUS_TOKEN:
        return Token(reply.get("index", 0), reply.get("token_id", 0), reply.get("text", ""))
    if status == STATUS_DONE:
        return Result.from_reply(reply)
    if status == STATUS_YIELD:
        return Yielded(str(reply.get("id")), int(reply.get("retry_hint_ms", 0)), str(reply.get("reason")))
    if status == STATUS_ERROR:
        return error_from_code(str(reply.get("code")), str(reply.get("message", "")), reply.get("id"))
    if status == STATUS_ACCEPTED:
        return ACCEPTED
    return None  # control answers (pong, stats, authenticated)


FINAL = (Result, Yielded, GovernorError)


class Session:
    """Request bookkeeping of one connection. `feed` returns (request id, event) pairs in order;
    control replies (ping, stats) come back as their raw dict."""

    def __init__(self, prefix: str = "c") -> None:
        self._ids = (f"{prefix}{n}" for n in itertools.count(1))
        self._splitter = LineSplitter(MAX_REPLY_BYTES)
        self._unacknowledged: deque[str] = deque()  # generate ids without a first reply yet, in send order
        self.open: set[str] = set()  # ids that may still get replies

    def auth_frame(self, secret: SharedSecret) -> bytes:
        return encode({"id": AUTH_ID, **secret.frame()})

    def generate(self, prompt: str, fields: dict[str, Any]) -> tuple[str, bytes]:
        rid = next(self._ids)
        self._unacknowledged.append(rid)
        self.open.add(rid)
        return rid, encode(generate_frame(rid, prompt, ack=True, **fields))

    def control(self, op: str) -> tuple[str, bytes]:
        rid = next(self._ids)
        self._unacknowledged.append(rid)
        self.open.add(rid)
        return rid, encode({"id": rid, "op": op})

    def cancel(self, rid: str) -> bytes:
        """Stop listening to `rid` and ask the governor to stop it (it answers with the final reply,
        which is then dropped)."""
        self.forget(rid)
        return encode({"id": rid, "op": OP_CANCEL})

    def forget(self, rid: str) -> None:
        self.open.discard(rid)
        if rid in self._unacknowledged:
            self._unacknowledged.remove(rid)

    def feed(self, data: bytes) -> list[tuple[str, Event | dict[str, Any]]]:
        out: list[tuple[str, Event | dict[str, Any]]] = []
        for line in self._splitter.feed(data):
            if line is TOO_LARGE:
                raise ConnectionLost(f"a reply exceeded {MAX_REPLY_BYTES} bytes")
            if not line:
                continue
            reply = orjson.loads(line)
            if type(reply) is not dict:
                raise ConnectionLost(f"not a reply: {line[:200]!r}")
            rid = reply.get("id")
            if rid is None and reply.get("status") == STATUS_ERROR and self._unacknowledged:
                rid = self._unacknowledged[0]  # the oldest frame still waiting for its first reply
            if rid == AUTH_ID:
                out.append((AUTH_ID, reply))
                continue
            if type(rid) is not str or rid not in self.open:
                continue  # a request given up on (cancelled, timed out), or a connection-level note
            if rid in self._unacknowledged and reply.get("status") != STATUS_TOKEN:
                self._unacknowledged.remove(rid)
            event = event_of(reply)
            if event is None:
                if reply.get("status") != STATUS_AUTHENTICATED:
                    out.append((rid, reply))  # ping / stats answers
                    self.open.discard(rid)
                continue
            if isinstance(event, FINAL):
                self.forget(rid)
            out.append((rid, event))
        return out
