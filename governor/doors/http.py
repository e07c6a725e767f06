"""The OpenAI-compatible front door, per connection: HTTP/1.1 bytes in, response bytes out. No sockets.

httptools (llhttp, uvicorn's parser) splits the byte stream into requests; everything after that is
the NDJSON port's path in HTTP clothes. A `POST /v1/completions` body becomes a generate frame
(openai_api.py) and goes through the same `Admission.decide`:

- refused: **429** at once, with `retry-after-ms` (the hint), `Retry-After` (whole seconds, rounded
  up) and an OpenAI-style error whose `code` is the yield reason; `draining` is a **503** with the
  same headers;
- admitted: its fields and `Content-Digest` are checked (a failure refunds the slot, **400**), then
  it is dispatched; no endpoint up is **503**.

Responses leave in request order (HTTP/1.1 has no ids), so a pipelined request waits until the one
before it has its whole response; at most `max_pipelined` may wait, then the connection stops being
read (`backlogged`). A streamed response's `200` is sent with its first token, so anything that
ends it before that (an upstream's 429, a deadline, a lost worker) still gets its own status.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import http_sfv
import httptools
import orjson
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from governor.accounting import CLIENT_DISCONNECTED, ShedReason
from governor.admission.appointments.appointment import Appointment
from governor.admission.appointments.lobby import Held
from governor.admission.limits import Grant, Refusal
from governor.doors import gateway
from governor.doors.gateway import (
    DROPPED,
    DROPPED_REASON,
    HEADROOM,
    NO_ENDPOINTS,
    QUEUE_DURATION,
    SATURATED,
)
from governor.doors.gateway_policy import GatewayPolicy
from governor.doors.openai_api import (
    DONE_EVENT,
    STATUS_OF_CODE,
    chat_chunk_event,
    chat_frame_of,
    chat_response,
    chunk_event,
    completion_response,
    cost_view,
    error_body,
    error_event,
    error_object,
    generate_frame_of,
    models_body,
    usage_event,
    wants_usage,
)
from governor.doors.shared import admit_and_dispatch, decide_frame, flush_pending
from governor.lifecycle import InflightRequest
from governor.state import ServerState
from govwire.errors import (
    BadFrame,
    BadJson,
    FrameTooLarge,
    GovernorError,
    IdleTimeout,
    IntegrityMismatch,
    InternalError,
    RequestRejected,
    Unauthorized,
)
from govwire.messages import Completion
from govwire.request import GenerateRequest, IntegrityMode, Limits, checked_request, is_tenant_name
from govwire.vocab import DEFAULT_TENANT, ErrorCode, YieldReason

log = logging.getLogger("governor.http")

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
_JSON = b"application/json"
# The headers read, each with whether it is a gateway's (gateway.HEADERS_IN); the rest are skipped.
_HEADERS_READ = {
    **dict.fromkeys(
        (b"content-length", b"authorization", b"content-digest", b"retry-ticket", b"content-type", b"expect"), False
    ),
    **dict.fromkeys(gateway.HEADERS_IN, True),
}
_HEADER_LENGTHS = frozenset(len(name) for name in _HEADERS_READ)
_SSE = b"text/event-stream"
_GET = (b"GET", b"HEAD")  # a HEAD is answered as its GET, without the body (see _advance)
_EXPOSITION = CONTENT_TYPE_LATEST.encode()


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A body's media types read as JSON: application/json and any +json type; no Content-Type at all
# is read as JSON too (what most clients that send JSON without saying so mean).
_JSON_TYPES = re.compile(rb"\s*application/([a-z0-9.+-]+\+)?json\s*(;.*)?", re.IGNORECASE)

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
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *(extra or ())]
    return status_line(status, headers, keep_alive) + body


def _error_response(error: GovernorError, keep: bool) -> bytes:
    """An admitted request's error, before any of its response: a 503 because no endpoint is up
    says so in llm-d's words too (`rejected-no-endpoints`)."""
    status = STATUS_OF_CODE.get(error.code, 500)
    extra = [(DROPPED, NO_ENDPOINTS)] if error.code == ErrorCode.WORKER_UNAVAILABLE else None
    return response(status, error_body(status, error), keep, extra)


def response_id(chat: bool) -> str:
    """A new response's id, random as OpenAI's (`cmpl-…`, `chatcmpl-…` for chat): unique across
    connections, processes and restarts, so logs, traces and clients that key on it never mix two
    requests (96 bits: a repeat is as likely as a uuid4's)."""
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def chunk(data: bytes) -> bytes:
    """One piece of a `Transfer-Encoding: chunked` body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


@dataclass(slots=True)
class _Message:
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


@dataclass(slots=True)
class _Parsed:
    """A completions request as read before admission: its message, its JSON body, the frame a
    chat request became (None for a completion: built once admitted), the chat messages, the
    model, and the body's bytes (what Content-Digest covers and what an SDK re-sends)."""

    message: _Message
    body: dict[str, Any]
    frame: dict[str, Any] | None
    messages: Any
    model: str
    raw: bytes


@dataclass(slots=True)
class _Exchange:
    """The admitted request being answered: how its response is written."""

    request: InflightRequest
    model: str
    stream: bool
    usage: bool
    keep_alive: bool
    created: int
    chat: bool = False  # rendered as chat.completion(.chunk)s
    chunked: bool = True  # HTTP/1.1; an HTTP/1.0 stream is sent as it comes and ends with the connection
    headers_sent: bool = False
    relayed: bool = False  # an OpenAI-compatible endpoint's events went out as they came
    usage_sent: bool = False  # one of them carried the usage
    feedback: list[tuple[bytes, bytes]] = field(default_factory=list)  # llm-d's headers on its 200

    def piece(self, data: bytes, last: bool = False) -> bytes:
        """Stream bytes in the response's framing."""
        if not self.chunked:
            return data
        return chunk(data) + LAST_CHUNK if last else chunk(data)


class HttpIngress:
    """One HTTP client connection's state machine. `write` receives response bytes (the transport
    adapter may swap it, as for NDJSON); `closing` set means the adapter closes the connection
    after what was written; `backlogged` tells it to stop reading until the queue drains."""

    def __init__(
        self,
        state: ServerState,
        write: Callable[[bytes], None],
        limits: HttpLimits,
        models: list[str],
        on_backlog: Callable[[bool], None] = lambda paused: None,
        on_close: Callable[[ShedReason | None], None] = lambda reason: None,
        metrics: Callable[[], bytes] | None = None,
        trusted: bool = False,
    ) -> None:
        self._state = state
        # Whether this connection's gateway headers may name its tenant (--tenant-from header, or
        # a --trusted-gateway peer).
        self._trusted = trusted
        # GET /metrics: the same exposition as --metrics-port (aiperf and others scrape the API's
        # base URL, where vLLM, TGI and SGLang serve it); no auth, as on the metrics port.
        self._metrics = metrics
        self._limits = limits
        self._models = models
        self._on_backlog = on_backlog
        # The adapter's close, once the last response is written: graceful when the client asked
        # for it (None), a shed when the connection is refused (`closing`).
        self._on_close = on_close
        self.write = write
        self._parser = httptools.HttpRequestParser(self)
        self._message: _Message | None = None  # being parsed
        self._header_bytes = 0
        self._queue: deque[_Message] = deque()  # parsed, waiting for the response before them
        self._exchange: _Exchange | None = None  # admitted, its response not complete
        self._lobby: Held | None = None  # back for its appointment and held for its capacity (lobby.py)
        self._pending: list[bytes] = []
        self._broken: tuple[int, GovernorError] | None = None  # a request the parser gave up on
        self._last_read = False  # a request said `connection: close`: it is the last one read
        self._headers_done = False  # of the request being read
        self._header_read = 0  # bytes of later reads spent on that request's unfinished headers
        self._began = False  # a request began during the current read
        self._frame_limits = Limits(state.limits.max_new_tokens, IntegrityMode.OFF)  # Content-Digest instead
        self.active: dict[str, InflightRequest] = {}
        self.tenant = DEFAULT_TENANT  # of the request being answered, for logs when shed
        self.closing: ShedReason | None = None  # the adapter sheds the connection with this reason
        self.finished = False  # the client asked to close: close once the replies are out
        self.backlogged = False
        self.last_line_at = state.clock()  # the idle timeout counts from here
        self.started_at: float | None = None  # when the request being read began arriving
        self._advancing = False  # the next request's answer is scheduled (`_next`)
        self._gone = False  # the connection is lost: nothing more is answered

    @property
    def buffered_bytes(self) -> int:
        """Request bytes held: the one being read and those waiting."""
        held = sum(m.body_bytes for m in self._queue)
        return held + (self._message.body_bytes + self._header_bytes if self._message is not None else 0)

    # -- bytes in ---------------------------------------------------------------------------------

    held_frames = 0
    """Requests are never held for a later turn: pipelined requests beyond `max_pipelined` stop
    the reading instead (`backlogged`)."""

    def receive_data(self, data: bytes) -> None:
        """Answer what the read completes."""
        if self.closing is not None or self.finished or self._broken is not None or self._last_read:
            return  # nothing after a request the parser gave up on, or after `connection: close`
        now = self._state.clock()
        self.last_line_at = now
        self._began = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # (the upgrade request itself was dropped, see below)
            self._fail(400, BadFrame("protocol upgrades (Upgrade: h2c, websocket) are not supported"))
        except httptools.HttpParserError as exc:
            if not self._last_read:  # bytes after a `connection: close` request: ignored, not an error
                self._fail(400, BadFrame(f"malformed HTTP request: {exc}"))  # unless a limit failed it first
        if self._message is not None and not self._headers_done and not self._began:
            # httptools hands a header to on_header only once it is whole: a header that never ends
            # is bounded here, by the reads wholly spent on it (its first read, where the request
            # began after others, counts nothing: one read is bounded anyway).
            self._header_read += len(data)
            if self._header_read > 2 * self._limits.max_header_bytes:
                self._fail(431, BadFrame(f"request headers exceed {self._limits.max_header_bytes} bytes"))
        self._advance(now)
        self.flush()

    def resume(self, budget: int) -> None:
        """Nothing is held (`held_frames`)."""

    # httptools callbacks (its parser calls these while feed_data runs)

    def on_message_begin(self) -> None:
        self._message = _Message()
        self._began = True
        self._header_bytes = self._header_read = 0
        self._headers_done = False
        self.started_at = self._state.clock()

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
        self._fail(431, BadFrame(f"request headers exceed {self._limits.max_header_bytes} bytes"))
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
            and self._exchange is None
            and self._lobby is None
            and not self._queue
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
        self._fail(413, FrameTooLarge(f"request body exceeds {n} bytes"))
        raise httptools.HttpParserError("body too large")

    def on_message_complete(self) -> None:
        message, self._message = self._message, None
        self.started_at = None
        if message is None or message.upgrade:
            return  # an upgrade is answered 400 once the parser stops on it (receive_data)
        self._last_read = not message.keep_alive  # nothing after it is read
        self._queue.append(message)
        if len(self._queue) > self._limits.max_pipelined and not self.backlogged:
            self.backlogged = True
            self._on_backlog(True)

    # -- answering, in order ----------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Answer queued requests until one is admitted (its response comes later) or none is left."""
        while not (self._exchange or self._lobby) and self._queue and self.closing is None and not self.finished:
            message = self._queue.popleft()
            accounting = self._state.accounting
            received = accounting.received
            try:
                answer = self._route(message, now)
                if message.method == b"HEAD":  # RFC 9110: the head GET would get, never a body
                    answer = answer[: answer.find(b"\r\n\r\n") + 4]
                self._pending.append(answer)
            except Exception:
                log.exception("event=internal_error where=http_route")
                accounting.frame_failed(InternalError.code)
                self._pending.append(response(500, error_body(500, InternalError("internal error")), False))
                self.closing = ShedReason.BAD_REQUEST
            # What this request was counted as (a yield, an admission, a rejection, and a failure
            # if a bug surfaced after one of those), all through this front door.
            accounting.http_received += accounting.received - received
            if not message.keep_alive and self._exchange is None and self._lobby is None:
                self.finished = True
        if (
            self._broken is not None
            and self._exchange is None
            and self._lobby is None
            and not self._queue
            and self.closing is None
        ):
            status, error = self._broken
            self._pending.append(response(status, error_body(status, error), False))
            self.closing = ShedReason.BAD_REQUEST
        if self.backlogged and len(self._queue) <= self._limits.max_pipelined // 2:
            self.backlogged = False
            self._on_backlog(False)

    def _route(self, message: _Message, now: float) -> bytes:
        path = message.url.split(b"?", 1)[0]
        keep = message.keep_alive
        if path == b"/v1/completions":
            if message.method != b"POST":
                return self._plain(405, "use POST", keep, [(b"allow", b"POST")])
            return self._completions(message, now)
        if path == b"/v1/models":
            if message.method not in _GET:
                return self._plain(405, "use GET", keep, [(b"allow", b"GET, HEAD")])
            unauthorized = self._authorize(message)
            if unauthorized is not None:
                return response(401, error_body(401, unauthorized), keep)
            return response(200, models_body(self._models, int(time.time())), keep)
        if path == b"/v1/chat/completions":
            if message.method != b"POST":
                return self._plain(405, "use POST", keep, [(b"allow", b"POST")])
            return self._completions(message, now, chat=True)
        if path == b"/metrics" and self._metrics is not None:
            if message.method not in _GET:
                return self._plain(405, "use GET", keep, [(b"allow", b"GET, HEAD")])
            body = self._metrics()
            return (
                status_line(200, [(b"content-type", _EXPOSITION), (b"content-length", b"%d" % len(body))], keep) + body
            )
        if path == b"/health":
            up = any(e.up for e in self._state.admission.pool.endpoints)
            return response(200 if up else 503, b'{"status":"%s"}' % (b"ok" if up else b"no endpoint up"), keep)
        return self._plain(404, f"no route {path.decode('latin-1')[:100]!r}", keep)

    @staticmethod
    def _plain(status: int, message: str, keep: bool, extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
        code = "not_found" if status == 404 else "method_not_allowed"
        return response(status, orjson.dumps(error_object(status, code, message)), keep, extra)

    def _authorize(self, message: _Message) -> Unauthorized | None:
        """With client secrets configured, `Authorization: Bearer <secret>` names the tenant."""
        auth = self._state.auth
        if auth is None:
            self.tenant = DEFAULT_TENANT
            return None
        scheme, _, token = message.headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        tenant = auth.tenant_of(token.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            return Unauthorized("a valid `Authorization: Bearer <token>` header is required")
        self.tenant = tenant
        return None

    def _completions(self, message: _Message, now: float, chat: bool = False) -> bytes:
        """`POST /v1/completions`, or with `chat` `POST /v1/chat/completions` (an OpenAI-compatible
        endpoint gets the messages as they are, a worker renders them with its chat template)."""
        state = self._state
        accounting = state.accounting
        keep = message.keep_alive
        rid = ""  # named once admitted: a refusal needs no id
        if state.auth is not None:
            unauthorized = self._authorize(message)
            if unauthorized is not None:
                accounting.frame_rejected(unauthorized.code)
                return response(401, error_body(401, unauthorized), keep)
        media_type = message.headers.get(b"content-type")
        if media_type is not None and not _JSON_TYPES.fullmatch(media_type):
            shown = media_type.decode("latin-1")[:100]
            return self._rejected(
                BadFrame(f"the body must be JSON (Content-Type: application/json), not {shown!r}"), keep, 415
            )
        parts = message.body
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        # Before admission only what it needs (as `frame_op` for a frame): the JSON, the model,
        # the cost. Every other field is checked once a slot was granted (a failure refunds it),
        # so refusing stays cheap whatever the body holds.
        frame: dict[str, Any] | None = None
        messages = None
        said: gateway.GatewayAsk | None = None
        try:
            body = orjson.loads(raw)
            if type(body) is not dict:
                raise BadFrame("the request body must be a JSON object", rid)
            model = body.get("model")
            if model is None:
                raise BadFrame("model is required; GET /v1/models lists the models served here", rid, field="model")
            if type(model) is not str or model not in self._models:
                shown = (model if type(model) is str else orjson.dumps(model).decode())[:100]
                raise BadFrame(f"model {shown!r} is not served here; GET /v1/models lists them", rid, field="model")
            # Its class and deadline go into the body, where every check reads them; an SDK's first
            # attempt, the common case (its retry count 0 and nothing else), says nothing to read.
            if message.gateway and (message.gateway > 1 or message.headers.get(gateway.RETRY_COUNT) != b"0"):
                said = gateway.read(message.headers, self._limits.gateway, self._trusted)
                gateway.apply(said, body)
                tenant = said.tenant
                user = body.get("user")
                if tenant is not None and state.tenant_from_frame and type(user) is str and user != tenant:
                    raise BadFrame(f"{gateway.FAIRNESS_ID[0].decode()} {tenant!r} contradicts the body's user")
            if chat:  # the messages' text is what the cost is estimated from: checked first
                frame, messages = chat_frame_of(body, rid)
        except orjson.JSONDecodeError as exc:
            return self._rejected(BadJson(f"invalid JSON: {exc}"), keep)
        except RequestRejected as exc:
            return self._rejected(exc, keep)
        ask = state.costs.ask(frame if frame is not None else cost_view(body))
        user = body.get("user")
        if said is not None and said.tenant is not None:  # a trusted gateway's fairness id
            ask.tenant = state.admission.tenants.resolve(said.tenant)
        elif state.tenant_from_frame and type(user) is str and is_tenant_name(user):
            ask.tenant = state.admission.tenants.resolve(user)
        else:
            ask.tenant = state.admission.tenants.resolve(self.tenant)
        ticket = message.headers.get(b"retry-ticket")
        if ticket is not None:
            ask.retry = True
            ask.ticket = ticket.decode("latin-1").strip()
        elif said is not None and said.retry_count > 0:
            ask.retry = True
        ask.resent = raw  # the OpenAI SDKs re-send the same body after `retry-after-ms`
        return decide_frame(state, self, _Parsed(message, body, frame, messages, model, raw), ask, now)

    # -- rendering the decision step's answers (shared.Renderer; the frame: a _Parsed request) ----

    def render_refusal(self, frame: _Parsed, refusal: Refusal) -> bytes:
        appointment = refusal.appointment
        keep = frame.message.keep_alive
        if appointment is None:
            return self._yield(refusal.hint_ms, refusal.reason, keep, None, refusal.final)
        return self._yield(refusal.hint_ms, refusal.reason, keep, appointment.ticket)

    def render_rejected(self, frame: _Parsed, error: RequestRejected) -> bytes:
        return self._rejected(error, frame.message.keep_alive)

    def park(self, frame: _Parsed, held: Held) -> None:
        """Held in the lobby: nothing after it on this connection is answered before it is
        (HTTP/1.1 answers in order), and the connection is not timed out meanwhile."""
        self._lobby = held

    def answer_held(self, frame: _Parsed, reply: bytes) -> None:
        self._lobby = None
        self._state.accounting.http_received += 1  # (counted once, as whatever it was answered)
        self._pending.append(reply)
        if not frame.message.keep_alive and self._exchange is None:
            self.finished = True
        self._advance(self._state.clock())
        self.flush()

    def render_admitted(self, frame: _Parsed, grant: Grant, now: float, queued_s: float) -> bytes:
        """Checked, dispatched, and its response begun (`_exchange`); or the error that refunded it.
        `queued_s`: how long it was held in the lobby."""
        state = self._state
        message = frame.message
        keep = message.keep_alive
        chat = frame.frame is not None
        rid = response_id(chat)
        if frame.frame is not None:
            frame.frame["id"] = rid

        def check() -> GenerateRequest:
            checked = generate_frame_of(frame.body, rid) if frame.frame is None else frame.frame
            self._verify_digest(message, frame.raw, rid)
            generate = checked_request(checked, self._frame_limits)
            generate.messages = frame.messages
            return generate

        admitted = admit_and_dispatch(state.lifecycle, self, rid, grant, now, check)
        if isinstance(admitted, GovernorError):
            return _error_response(admitted, keep)
        request, generate = admitted
        stream = generate.stream
        chunked = message.http11
        keep = keep and (chunked or not stream)  # an HTTP/1.0 stream ends with its connection
        # llm-d's response feedback: how long it waited (in the lobby), and how many more like it
        # would be admitted now.
        feedback = [
            (QUEUE_DURATION, b"%d" % round(queued_s * 1000)),
            (HEADROOM, b"%d" % state.admission.headroom(grant, now)),
        ]
        self._exchange = _Exchange(
            request,
            frame.model,
            stream,
            wants_usage(frame.body),
            keep,
            int(time.time()),
            chat,
            chunked,
            feedback=feedback,
        )
        return b""

    def _verify_digest(self, message: _Message, body: bytes, rid: str) -> None:
        """RFC 9530 `Content-Digest` over the body: verified when present (sha-256; other
        algorithms are ignored), required under `--http-integrity required`."""
        mode = self._limits.integrity
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

    def _rejected(self, error: RequestRejected, keep: bool, status: int = 0) -> bytes:
        self._state.accounting.frame_rejected(error.code)
        status = status or STATUS_OF_CODE.get(error.code, 400)
        return response(status, error_body(status, error), keep)

    @staticmethod
    def _yield(hint_ms: int, reason: str, keep: bool, ticket: str | None = None, final: bool = False) -> bytes:
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

    def _fail(self, status: int, error: GovernorError) -> None:
        """A request the parser cannot go on with: counted now, answered after the requests before
        it (`_advance`), and then the connection is closed."""
        if self._broken is None:
            self._state.accounting.http_received += 1
            self._state.accounting.frame_rejected(error.code)
            self._broken = (status, error)
            self._message = None
            self.started_at = None

    # -- the admitted request's response, rendering what the lifecycle decided (RequestOwner) --------

    def _head(self, exchange: _Exchange) -> None:
        if not exchange.headers_sent:
            exchange.headers_sent = True
            headers = [(b"content-type", _SSE), (b"cache-control", b"no-cache"), *exchange.feedback]
            if exchange.chunked:
                headers.append((b"transfer-encoding", b"chunked"))
            self._pending.append(status_line(200, headers, exchange.keep_alive))
            if exchange.chat and not exchange.relayed:  # a relayed chat stream has the endpoint's
                rid = exchange.request.client_id
                role = chat_chunk_event(rid, exchange.model, exchange.created, "", role=True)
                self._pending.append(exchange.piece(role))

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        """A worker's token: rendered as a completion (or chat) chunk of our own."""
        exchange = self._exchange
        if exchange is not None and exchange.request is request and exchange.stream:
            text = orjson.loads(b'{"id":0' + rest).get("text", "")
            self._head(exchange)
            event = chat_chunk_event if exchange.chat else chunk_event
            chunk = event(request.client_id, exchange.model, exchange.created, text if type(text) is str else str(text))
            self._pending.append(exchange.piece(chunk))

    def relay_event(self, request: InflightRequest, text: str, event: bytes, usage: bool, only_usage: bool) -> None:
        """An OpenAI-compatible endpoint's event, relayed as its bytes: the request and the
        endpoint speak the same format (completions or chat, as the request came), so nothing is
        re-encoded (the chunks carry the endpoint's id). A usage chunk goes only to a client that
        asked for usage."""
        exchange = self._exchange
        if exchange is None or exchange.request is not request or not exchange.stream:
            return
        if usage:
            if only_usage and not exchange.usage:
                return
            exchange.usage_sent = True
        exchange.relayed = True
        self._head(exchange)
        self._pending.append(exchange.piece(b"data: " + event + b"\n\n"))

    def send_done(self, request: InflightRequest, completion: Completion) -> None:
        exchange = self._end(request)
        if exchange is None:
            return
        rid, model, created = request.client_id, exchange.model, exchange.created
        if exchange.stream:
            self._head(exchange)
            usage = b""
            if exchange.usage and not exchange.usage_sent:  # estimated where the endpoint gave none
                usage = usage_event(rid, model, created, completion, exchange.chat)
            if exchange.relayed:  # the endpoint's finish chunk went through
                final = b""
            else:
                event = chat_chunk_event if exchange.chat else chunk_event
                final = event(rid, model, created, "", completion.finish_reason)
            self._pending.append(exchange.piece(final + usage + DONE_EVENT, last=True))
        else:
            render = chat_response if exchange.chat else completion_response
            body = render(rid, model, created, completion)
            self._pending.append(response(200, body, exchange.keep_alive, exchange.feedback))
        self._next(exchange)

    def send_error(self, request: InflightRequest, error: GovernorError) -> None:
        exchange = self._end(request)
        if exchange is None:
            return
        if exchange.headers_sent:
            self._pending.append(exchange.piece(error_event(error) + DONE_EVENT, last=True))
        else:
            self._pending.append(_error_response(error, exchange.keep_alive))
        self._next(exchange)

    def send_yield(
        self, request: InflightRequest, retry_hint_ms: int, reason: str, appointment: Appointment | None = None
    ) -> None:
        exchange = self._end(request)
        if exchange is None:
            return
        # (an appointment admission named by what the client re-sends: the request's body)
        ticket = None if appointment is None else appointment.ticket
        final = ticket is None and self._state.admission.is_final(reason, retry_hint_ms)
        self._pending.append(self._yield(retry_hint_ms, reason, exchange.keep_alive, ticket, final))
        self._next(exchange)

    def _end(self, request: InflightRequest) -> _Exchange | None:
        exchange = self._exchange
        if exchange is None or exchange.request is not request:
            return None
        self._exchange = None
        return exchange

    def _next(self, exchange: _Exchange) -> None:
        """The response is complete: close if the client asked to, else answer what waits, on
        the next turn of the loop (this runs inside an endpoint's read or a lifecycle's settle,
        which must not decide another request)."""
        if not exchange.keep_alive:
            self.finished = True
            return
        if not self._advancing and (self._queue or self._broken is not None or self.backlogged):
            self._advancing = True
            self._state.timers.call_later(0.0, self._advance_later)

    def _advance_later(self) -> None:
        self._advancing = False
        if not self._gone:
            self._advance(self._state.clock())
            self.flush()  # a timer fired: no read will flush it

    def flush(self) -> None:
        flush_pending(self._pending, self.write)
        if self.closing is not None or self.finished:
            self._on_close(self.closing)

    # -- the connection -----------------------------------------------------------------------------

    def connection_lost(self, reason: str = CLIENT_DISCONNECTED) -> None:
        self._gone = True
        state = self._state
        state.lifecycle.abandon(self, reason)
        if self._lobby is not None:  # held for its capacity: its appointment goes back
            state.lobby.leave(self._lobby)
            self._lobby = None
            state.accounting.http_received += 1
            state.accounting.frame_failed(reason)
        self._exchange = None
        self._queue.clear()
        self._pending.clear()

    def fail_internal(self) -> None:
        self._state.accounting.http_received += 1
        self._state.accounting.frame_failed(InternalError.code)
        if self._exchange is None or not self._exchange.headers_sent:
            self._pending.append(response(500, error_body(500, InternalError("internal error")), False))
        self.flush()

    def timeout(self, now: float, idle_timeout_s: float) -> tuple[ShedReason, GovernorError | None] | None:
        """A request that is taking too long to arrive (slow headers or body): 408. A connection
        idle between requests: closed without a word."""
        started = self.started_at
        waiting_on_us = self._exchange is not None or self._lobby is not None or bool(self._queue)
        if started is not None and not waiting_on_us and now - started > self._limits.request_timeout_s:
            return ShedReason.SLOW_REQUEST, IdleTimeout(
                f"the request did not arrive within {self._limits.request_timeout_s:g} s"
            )
        if idle_timeout_s and not self.active and not self._queue and now - self.last_line_at > idle_timeout_s:
            return ShedReason.IDLE, None
        return None

    def last_words(self, error: GovernorError) -> bytes:
        """The reply written when the connection is shed: a response, unless one is under way."""
        if self._exchange is not None and self._exchange.headers_sent:
            return b""
        status = STATUS_OF_CODE.get(error.code, 503)
        # (a connection refused for capacity, too_many_connections or buffer_full, says so to a gateway)
        extra = [(DROPPED, SATURATED)] if status == 503 else None
        return response(status, error_body(status, error), False, extra)
