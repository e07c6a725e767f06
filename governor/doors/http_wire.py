"""HTTP/1.1 on a connection, sans-IO: request bytes into messages (httptools, llhttp: uvicorn's
parser, under our limits) and responses into bytes. What a request means is http.py's (the
OpenAI-compatible exchange); this module knows heads, bodies, pipelining and the refusal bytes
the hot path writes.
"""

from __future__ import annotations

import base64
import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import http_sfv
import httptools

from governor.doors import gateway
from governor.doors.gateway import DROPPED, DROPPED_REASON, SATURATED
from governor.doors.gateway_policy import GatewayPolicy
from govwire.errors import BadFrame, FrameTooLarge, GovernorError, IntegrityMismatch
from govwire.request import IntegrityMode
from govwire.vocab import YieldReason

_DRAINING = YieldReason.DRAINING.value
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    415: b"Unsupported Media Type",
    431: b"Request Header Fields Too Large",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
JSON = b"application/json"
# The headers read, each with whether it is a gateway's (gateway.HEADERS_IN); the rest are skipped.
_HEADERS_READ = {
    **dict.fromkeys(
        (b"content-length", b"authorization", b"content-digest", b"retry-ticket", b"content-type", b"expect"), False
    ),
    **dict.fromkeys(gateway.HEADERS_IN, True),
}
_HEADER_LENGTHS = frozenset(len(name) for name in _HEADERS_READ)


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_429 = (429, b"Too Many Requests", b"rate_limit_error")
_YIELD_HEAD = (
    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"x-should-retry: true\r\n" + DROPPED + b": %s\r\n"
)
_YIELD_WAIT = b"retry-after-ms: %d\r\nretry-after: %d\r\n%s%s\r\n"
# A final refusal (past the promise horizon): no wait to honour. `x-should-retry: false` is what
# the Stainless-generated SDKs (openai, anthropic) obey before any retry count or Retry-After.
_FINAL_HEAD = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"x-should-retry: false\r\n" + DROPPED + b": %s\r\n%s\r\n"
)
# The same bytes for every yield of a reason: load generators count errors by their body (aiperf
# keys them by status, reason and body), so a number in it made a row per hint. The wait is in
# the headers, which the OpenAI SDKs read.
_YIELD_BODY = b'{"error":{"message":"yielded: %s","type":"%s","param":null,"code":"%s","reason":"%s"}}'
_FINAL_BODY = (
    b'{"error":{"message":"overloaded: no capacity within the promise horizon (%s); do not retry now",'
    b'"type":"rate_limit_error","param":null,"code":"overloaded","reason":"%s","final":true}}'
)


def _yield_parts(reason: str) -> tuple[bytes, bytes]:
    """A yield of `reason`, but its wait: the head up to `retry-after-ms`, and the body."""
    word = reason.encode()
    status, phrase, kind = (503, b"Service Unavailable", b"service_unavailable") if reason == _DRAINING else _429
    body = _YIELD_BODY % (word, kind, word, word)
    return _YIELD_HEAD % (status, phrase, len(body), DROPPED_REASON.get(reason, SATURATED)), body


def _final(reason: str, keep: bool) -> bytes:
    """A final refusal of `reason`: the same bytes every time."""
    word = reason.encode()
    body = _FINAL_BODY % (word, word)
    close = b"" if keep else b"connection: close\r\n"
    return _FINAL_HEAD % (len(body), DROPPED_REASON.get(reason, SATURATED), close) + body


# Built once: the refusal path under overload only adds the wait.
_YIELDS = {reason.value: _yield_parts(reason.value) for reason in YieldReason}
_FINALS = {(reason.value, keep): _final(reason.value, keep) for reason in YieldReason for keep in (True, False)}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_body_bytes: int = 1024 * 1024  # Content-Length (or chunked total) of one request
    max_header_bytes: int = 64 * 1024  # request line and headers of one request
    max_pipelined: int = 16  # requests parsed and waiting behind the one being answered
    request_timeout_s: float = 10.0  # a request's headers and body must arrive within this
    integrity: IntegrityMode = IntegrityMode.OPTIONAL  # Content-Digest (--http-integrity)
    gateway: GatewayPolicy = field(default_factory=GatewayPolicy)  # which gateway headers count, and how


def status_line(status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """A response head. (Writing one is formatting, not parsing: uvicorn builds its own the same way.)"""
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Unknown"))]
    lines.extend(name + b": " + value for name, value in headers)
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def response(status: int, body: bytes, keep_alive: bool, extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
    headers = [(b"content-type", JSON), (b"content-length", str(len(body)).encode()), *(extra or ())]
    return status_line(status, headers, keep_alive) + body


def chunk(data: bytes) -> bytes:
    """One piece of a `Transfer-Encoding: chunked` body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


@dataclass(slots=True)
class Message:
    """One request as parsed: method, path, the headers it needs (lower-case names), its body."""

    method: bytes = b""
    url: bytes = b""
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    keep_alive: bool = True
    http11: bool = True  # else HTTP/1.0: no chunked encoding, a stream ends with the connection
    upgrade: bool = False
    gateway: int = 0  # how many gateway headers it carries (gateway.HEADERS_IN)
    # What the exchange (http.py) read of a completions request before admission, kept on the
    # request itself (no record built per request): its JSON body, the frame a chat request
    # became (a completion's is built once admitted), the chat messages, the model, and the body's
    # bytes (what Content-Digest covers and what an SDK re-sends).
    json: Any = None  # (a dict once read: none is built for requests that never get that far)
    chat_frame: dict[str, Any] | None = None
    messages: Any = None
    model: str = ""
    raw: bytes = b""


def yield_response(hint_ms: int, reason: str, keep: bool, ticket: str | None = None, final: bool = False) -> bytes:
    """The 429 (503 for `draining`): the hot path under overload, formatted in one step. The
    body is `error_object(status, reason, ..., reason=reason)`, the hint in `retry-after-ms`
    and `Retry-After` beside `x-should-retry: true`; a booked appointment's ticket goes in a
    `retry-ticket` header (the retry sends it back). A `final` one is a 429 with
    `x-should-retry: false`, no wait, and the code `overloaded` (its `reason`: the limit)."""
    if final:
        return _FINALS.get((reason, keep)) or _final(reason, keep)
    head, body = _YIELDS.get(reason) or _yield_parts(reason)
    close = b"" if keep else b"connection: close\r\n"
    extra = b"" if ticket is None else b"retry-ticket: %s\r\n" % ticket.encode()
    return head + _YIELD_WAIT % (hint_ms, -(-hint_ms // 1000), extra, close) + body


def verify_content_digest(message: Message, body: bytes, mode: IntegrityMode, rid: str) -> None:
    """RFC 9530 `Content-Digest` over the body: verified when present (sha-256; other
    algorithms are ignored), required under `--http-integrity required`."""
    if mode is IntegrityMode.OFF:
        return
    header = message.headers.get(b"content-digest")
    if header is None:
        if mode is IntegrityMode.REQUIRED:
            raise BadFrame("Content-Digest: sha-256=:<base64>: is required (--http-integrity required)", rid)
        return
    digests = http_sfv.Dictionary()  # type: ignore[attr-defined]
    try:
        digests.parse(header)
    except ValueError as exc:
        raise BadFrame(f"Content-Digest is not a structured-field dictionary: {exc}", rid) from None
    item = digests.get("sha-256")
    if item is None:
        raise BadFrame("Content-Digest has no sha-256 digest", rid)
    if not isinstance(item.value, bytes):
        raise BadFrame("Content-Digest sha-256 must be a byte sequence (:base64:)", rid)
    if item.value != hashlib.sha256(body).digest():
        got = base64.b64encode(item.value).decode()[:64]
        raise IntegrityMismatch(f"Content-Digest mismatch: sha-256 of the body differs from {got}", rid)


class RequestReader:
    """One connection's request bytes into `Message`s, under `HttpLimits`: httptools calls the
    `on_*` methods while `feed` runs. Parsed requests wait in `queue` for their answer (HTTP/1.1
    answers in order); past `max_pipelined` the connection stops being read (`backlogged`) until
    the queue is half drained. A request the parser cannot go on with is `broken`: answered
    after the ones before it, then the connection closes."""

    def __init__(
        self,
        limits: HttpLimits,
        clock: Callable[[], float],
        pending: list[bytes],
        idle: Callable[[], bool],
        on_broken: Callable[[GovernorError], None],
        on_backlog: Callable[[bool], None],
    ) -> None:
        self._limits = limits
        self._clock = clock
        self._pending = pending  # the connection's replies (an interim `100 Continue` goes there)
        self._idle = idle  # nothing is being answered: an interim response cannot land inside one
        self._on_broken = on_broken  # counted when it happens
        self._on_backlog = on_backlog
        self._parser = httptools.HttpRequestParser(self)
        self._message: Message | None = None  # being parsed
        self._header_bytes = 0
        self._headers_done = False  # of the request being read
        self._header_read = 0  # bytes of later reads spent on that request's unfinished headers
        self._began = False  # a request began during the current read
        self.queue: deque[Message] = deque()  # parsed, waiting for the response before them
        self.broken: tuple[int, GovernorError] | None = None  # a request the parser gave up on
        self.last_read = False  # a request said `connection: close`: it is the last one read
        self.backlogged = False
        self.started_at: float | None = None  # when the request being read began arriving

    @property
    def buffered_bytes(self) -> int:
        """Request bytes held: the one being read and those waiting."""
        held = sum(m.body_bytes for m in self.queue)
        return held + (self._message.body_bytes + self._header_bytes if self._message is not None else 0)

    def feed(self, data: bytes) -> None:
        """Parse a read: the requests it completes go to `queue`."""
        self._began = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # (the upgrade request itself was dropped, see below)
            self.fail(400, BadFrame("protocol upgrades (Upgrade: h2c, websocket) are not supported"))
        except httptools.HttpParserError as exc:
            if not self.last_read:  # bytes after a `connection: close` request: ignored, not an error
                self.fail(400, BadFrame(f"malformed HTTP request: {exc}"))  # unless a limit failed it first
        if self._message is not None and not self._headers_done and not self._began:
            # httptools hands a header to on_header only once it is whole: a header that never ends
            # is bounded here, by the reads wholly spent on it (its first read, where the request
            # began after others, counts nothing: one read is bounded anyway).
            self._header_read += len(data)
            if self._header_read > 2 * self._limits.max_header_bytes:
                self.fail(431, BadFrame(f"request headers exceed {self._limits.max_header_bytes} bytes"))

    def fail(self, status: int, error: GovernorError) -> None:
        """A request the parser cannot go on with: answered (`status`) after the requests before
        it, and then the connection is closed."""
        if self.broken is None:
            self._on_broken(error)
            self.broken = (status, error)
            self._message = None
            self.started_at = None

    def drained(self) -> None:
        """A queued request was taken: reading resumes once half the queue is answered."""
        if self.backlogged and len(self.queue) <= self._limits.max_pipelined // 2:
            self.backlogged = False
            self._on_backlog(False)

    # -- httptools callbacks (its parser calls these while feed_data runs) ------------------------

    def on_message_begin(self) -> None:
        self._message = Message()
        self._began = True
        self._header_bytes = self._header_read = 0
        self._headers_done = False
        self.started_at = self._clock()

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        if self._header_bytes > self._limits.max_header_bytes:
            self._headers_too_large()
        if self._message is not None:
            self._message.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._limits.max_header_bytes:
            self._headers_too_large()
        message = self._message
        if message is None or len(name) not in _HEADER_LENGTHS:  # most headers, without a lower()
            return
        key = name.lower()
        kind = _HEADERS_READ.get(key)
        if kind is None:
            return
        if kind:
            message.gateway += 1
        # A repeated one is joined, as RFC 9110 allows for lists.
        if key in message.headers:
            message.headers[key] += b", " + value
        else:
            message.headers[key] = value

    def _headers_too_large(self) -> None:
        self.fail(431, BadFrame(f"request headers exceed {self._limits.max_header_bytes} bytes"))
        raise httptools.HttpParserError("headers too large")

    def on_headers_complete(self) -> None:
        message = self._message
        if message is None:
            return
        self._headers_done = True
        message.method = self._parser.get_method()
        message.keep_alive = self._parser.should_keep_alive()
        message.http11 = self._parser.get_http_version() == "1.1"
        message.upgrade = self._parser.should_upgrade()
        length = message.headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._limits.max_body_bytes:
            self._too_large()
        if (
            message.http11
            and message.headers.get(b"expect", b"").lower() == b"100-continue"
            and not self.queue
            and self._idle()
        ):
            # The client waits for this before sending its body (curl: a second, then sends it
            # anyway). Only when nothing is being answered: an interim response must not land
            # inside an earlier request's.
            self._pending.append(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        message = self._message
        if message is None:
            return
        message.body_bytes += len(body)
        if message.body_bytes > self._limits.max_body_bytes:
            self._too_large()
        message.body.append(body)

    def _too_large(self) -> None:
        n = self._limits.max_body_bytes
        self.fail(413, FrameTooLarge(f"request body exceeds {n} bytes"))
        raise httptools.HttpParserError("body too large")

    def on_message_complete(self) -> None:
        message, self._message = self._message, None
        self.started_at = None
        if message is None or message.upgrade:
            return  # an upgrade is answered 400 once the parser stops on it (receive_data)
        self.last_read = not message.keep_alive  # nothing after it is read
        self.queue.append(message)
        if len(self.queue) > self._limits.max_pipelined and not self.backlogged:
            self.backlogged = True
            self._on_backlog(True)
