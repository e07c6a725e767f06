"""The OpenAI-compatible front door, per connection: HTTP/1.1 bytes in, response bytes out. No sockets.

Its requests are read by http_wire.py (httptools, under our limits); everything after that is the
NDJSON port's path in HTTP clothes. A `POST /v1/completions` body becomes a generate frame
(openai_api.py) and takes the decision step both doors share (shared.py):

- refused: **429** at once, with `retry-after-ms` (the hint), `Retry-After` (whole seconds, rounded
  up) and an OpenAI-style error whose `code` is the yield reason; `draining` is a **503** with the
  same headers;
- admitted: its fields and `Content-Digest` are checked (a failure refunds the slot, **400**), then
  it is dispatched; no endpoint up is **503**; its response is an `Exchange` (openai_response.py).

Responses leave in request order (HTTP/1.1 has no ids), so a pipelined request waits until the one
before it has its whole response, and is decided on the next turn of the loop after that response
ended (never inside the endpoint's read that ended it); at most `max_pipelined` may wait, then the
connection stops being read (`backlogged`).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable

import orjson
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from governor.accounting import CLIENT_DISCONNECTED, ShedReason
from governor.admission.appointments.appointment import Appointment
from governor.admission.appointments.lobby import Held
from governor.admission.limits import Grant, Refusal
from governor.doors import gateway
from governor.doors.gateway import (
    DROPPED,
    HEADROOM,
    QUEUE_DURATION,
    SATURATED,
)
from governor.doors.http_wire import (
    HttpLimits,
    Message,
    RequestReader,
    response,
    status_line,
    verify_content_digest,
    yield_response,
)
from governor.doors.openai_api import (
    STATUS_OF_CODE,
    chat_frame_of,
    cost_view,
    error_body,
    error_object,
    generate_frame_of,
    models_body,
    wants_usage,
)
from governor.doors.openai_response import Exchange, error_response
from governor.doors.shared import admit_and_dispatch, decide_frame, flush_pending
from governor.lifecycle import InflightRequest
from governor.state import ServerState
from govwire.errors import (
    BadFrame,
    BadJson,
    GovernorError,
    IdleTimeout,
    InternalError,
    RequestRejected,
    Unauthorized,
)
from govwire.messages import Completion
from govwire.request import GenerateRequest, IntegrityMode, Limits, checked_request, is_tenant_name
from govwire.vocab import DEFAULT_TENANT

log = logging.getLogger("governor.http")

_GET = (b"GET", b"HEAD")  # a HEAD is answered as its GET, without the body (see _advance)
_EXPOSITION = CONTENT_TYPE_LATEST.encode()
# A body's media types read as JSON: application/json and any +json type; no Content-Type at all
# is read as JSON too (what most clients that send JSON without saying so mean).
_JSON_TYPES = re.compile(rb"\s*application/([a-z0-9.+-]+\+)?json\s*(;.*)?", re.IGNORECASE)


def response_id(chat: bool) -> str:
    """A new response's id, random as OpenAI's (`cmpl-…`, `chatcmpl-…` for chat): unique across
    connections, processes and restarts, so logs, traces and clients that key on it never mix two
    requests (96 bits: a repeat is as likely as a uuid4's)."""
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


class HttpIngress:
    """One HTTP client connection's state machine. `write` receives response bytes (the transport
    adapter may swap it, as for NDJSON); `closing` set means the adapter closes the connection
    after what was written; `on_backlog` tells it to stop reading until the queue drains, and to
    read again."""

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
        # The adapter's close, once the last response is written: graceful when the client asked
        # for it (None), a shed when the connection is refused (`closing`).
        self._on_close = on_close
        self.write = write
        self._pending: list[bytes] = []
        self._reader = RequestReader(limits, state.clock, self._pending, self._idle, self._count_broken, on_backlog)
        self._exchange: Exchange | None = None  # admitted, its response not complete
        self._lobby: Held | None = None  # back for its appointment and held for its capacity (lobby.py)
        self._frame_limits = Limits(state.limits.max_new_tokens, IntegrityMode.OFF)  # Content-Digest instead
        self.active: dict[str, InflightRequest] = {}
        self.tenant = DEFAULT_TENANT  # of the request being answered, for logs when shed
        self.closing: ShedReason | None = None  # the adapter sheds the connection with this reason
        self.finished = False  # the client asked to close: close once the replies are out
        self.last_line_at = state.clock()  # the idle timeout counts from here
        self._advancing = False  # the next request's answer is scheduled (`_next`)
        self._gone = False  # the connection is lost: nothing more is answered

    @property
    def buffered_bytes(self) -> int:
        """Request bytes held: the one being read and those waiting."""
        return self._reader.buffered_bytes

    # -- bytes in ---------------------------------------------------------------------------------

    held_frames = 0
    """Requests are never held for a later turn: pipelined requests beyond `max_pipelined` stop
    the reading instead (`backlogged`)."""

    def receive_data(self, data: bytes) -> None:
        """Answer what the read completes."""
        reader = self._reader
        if self.closing is not None or self.finished or reader.broken is not None or reader.last_read:
            return  # nothing after a request the parser gave up on, or after `connection: close`
        now = self._state.clock()
        self.last_line_at = now
        reader.feed(data)
        self._advance(now)
        self.flush()

    def resume(self, budget: int) -> None:
        """Nothing is held (`held_frames`)."""

    def _idle(self) -> bool:
        return self._exchange is None and self._lobby is None

    def _count_broken(self, error: GovernorError) -> None:
        """A request the parser gave up on: counted now (answered after those before it)."""
        self._state.accounting.http_received += 1
        self._state.accounting.frame_rejected(error.code)

    # -- answering, in order ----------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Answer queued requests until one is admitted (its response comes later) or none is left."""
        reader = self._reader
        queue = reader.queue
        while not (self._exchange or self._lobby) and queue and self.closing is None and not self.finished:
            message = queue.popleft()
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
        broken = reader.broken
        if broken is not None and self._idle() and not queue and self.closing is None:
            status, error = broken
            self._pending.append(response(status, error_body(status, error), False))
            self.closing = ShedReason.BAD_REQUEST
        reader.drained()

    def _route(self, message: Message, now: float) -> bytes:
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

    def _authorize(self, message: Message) -> Unauthorized | None:
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

    def _completions(self, message: Message, now: float, chat: bool = False) -> bytes:
        """`POST /v1/completions`, or with `chat` `POST /v1/chat/completions` (an OpenAI-compatible
        endpoint gets the messages as they are, a worker renders them with its chat template)."""
        state = self._state
        keep = message.keep_alive
        if state.auth is not None:
            unauthorized = self._authorize(message)
            if unauthorized is not None:
                state.accounting.frame_rejected(unauthorized.code)
                return response(401, error_body(401, unauthorized), keep)
        media_type = message.headers.get(b"content-type")
        if media_type is not None and not _JSON_TYPES.fullmatch(media_type):
            shown = media_type.decode("latin-1")[:100]
            return self._rejected(
                BadFrame(f"the body must be JSON (Content-Type: application/json), not {shown!r}"), keep, 415
            )
        try:
            said = self._parse(message, chat)
        except orjson.JSONDecodeError as exc:
            return self._rejected(BadJson(f"invalid JSON: {exc}"), keep)
        except RequestRejected as exc:
            return self._rejected(exc, keep)
        # What it asks of admission: its cost, its tenant (a trusted gateway's fairness id, else
        # the body's user under --tenant-from frame, else the connection's), whether it retries,
        # and what its client would re-send (the OpenAI SDKs re-send the same body).
        json = message.json
        ask = state.costs.ask(message.chat_frame if message.chat_frame is not None else cost_view(json))
        user = json.get("user")
        if said is not None and said.tenant is not None:
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
        ask.resent = message.raw
        return decide_frame(state, self, message, ask, now)

    def _parse(self, message: Message, chat: bool) -> gateway.GatewayAsk | None:
        """Before admission only what it needs (as `frame_op` for a frame), kept on the message:
        the JSON, the model, the cost, what a trusted gateway says. Every other field is checked
        once a slot was granted (a failure refunds it), so refusing stays cheap whatever the body
        holds."""
        parts = message.body
        raw = message.raw = parts[0] if len(parts) == 1 else b"".join(parts)
        rid = ""  # named once admitted: a refusal needs no id
        said: gateway.GatewayAsk | None = None
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
            if tenant is not None and self._state.tenant_from_frame and type(user) is str and user != tenant:
                raise BadFrame(f"{gateway.FAIRNESS_ID[0].decode()} {tenant!r} contradicts the body's user")
        if chat:  # the messages' text is what the cost is estimated from: checked first
            message.chat_frame, message.messages = chat_frame_of(body, rid)
        message.json, message.model = body, model
        return said

    # -- rendering the decision step's answers (shared.Renderer; the frame: the request's Message) ----

    def render_refusal(self, frame: Message, refusal: Refusal) -> bytes:
        appointment = refusal.appointment
        keep = frame.keep_alive
        if appointment is None:
            return yield_response(refusal.hint_ms, refusal.reason, keep, None, refusal.final)
        return yield_response(refusal.hint_ms, refusal.reason, keep, appointment.ticket)

    def render_rejected(self, frame: Message, error: RequestRejected) -> bytes:
        return self._rejected(error, frame.keep_alive)

    def park(self, frame: Message, held: Held) -> None:
        """Held in the lobby: nothing after it on this connection is answered before it is
        (HTTP/1.1 answers in order), and the connection is not timed out meanwhile."""
        self._lobby = held

    def answer_held(self, frame: Message, reply: bytes) -> None:
        self._lobby = None
        self._state.accounting.http_received += 1  # (counted once, as whatever it was answered)
        self._pending.append(reply)
        if not frame.keep_alive and self._exchange is None:
            self.finished = True
        self._advance(self._state.clock())
        self.flush()

    def render_admitted(self, frame: Message, grant: Grant, now: float, queued_s: float) -> bytes:
        """Checked, dispatched, and its response begun (`_exchange`); or the error that refunded it.
        `queued_s`: how long it was held in the lobby."""
        state = self._state
        message = frame
        keep = message.keep_alive
        chat = frame.chat_frame is not None
        rid = response_id(chat)
        if frame.chat_frame is not None:
            frame.chat_frame["id"] = rid

        def check() -> GenerateRequest:
            checked = generate_frame_of(frame.json, rid) if frame.chat_frame is None else frame.chat_frame
            verify_content_digest(message, frame.raw, self._limits.integrity, rid)
            generate = checked_request(checked, self._frame_limits)
            generate.messages = frame.messages
            return generate

        admitted = admit_and_dispatch(state.lifecycle, self, rid, grant, now, check)
        if isinstance(admitted, GovernorError):
            return error_response(admitted, keep)
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
        self._exchange = Exchange(
            request,
            frame.model,
            stream,
            wants_usage(frame.json),
            keep,
            int(time.time()),
            chat,
            chunked,
            feedback=feedback,
        )
        return b""

    def _rejected(self, error: RequestRejected, keep: bool, status: int = 0) -> bytes:
        self._state.accounting.frame_rejected(error.code)
        status = status or STATUS_OF_CODE.get(error.code, 400)
        return response(status, error_body(status, error), keep)

    # -- the admitted request's response, rendering what the lifecycle decided (RequestOwner) --------

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        exchange = self._exchange
        if exchange is not None and exchange.request is request and exchange.stream:
            self._pending.append(exchange.token(rest))

    def relay_event(self, request: InflightRequest, text: str, event: bytes, usage: bool, only_usage: bool) -> None:
        exchange = self._exchange
        if exchange is not None and exchange.request is request and exchange.stream:
            self._pending.append(exchange.relay(event, usage, only_usage))

    def send_done(self, request: InflightRequest, completion: Completion) -> None:
        exchange = self._end(request)
        if exchange is not None:
            self._pending.append(exchange.done(completion))
            self._next(exchange)

    def send_error(self, request: InflightRequest, error: GovernorError) -> None:
        exchange = self._end(request)
        if exchange is not None:
            self._pending.append(exchange.error(error))
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
        self._pending.append(yield_response(retry_hint_ms, reason, exchange.keep_alive, ticket, final))
        self._next(exchange)

    def _end(self, request: InflightRequest) -> Exchange | None:
        exchange = self._exchange
        if exchange is None or exchange.request is not request:
            return None
        self._exchange = None
        return exchange

    def _next(self, exchange: Exchange) -> None:
        """The response is complete: close if the client asked to, else answer what waits, on
        the next turn of the loop (this runs inside an endpoint's read or a lifecycle's settle,
        which must not decide another request)."""
        if not exchange.keep_alive:
            self.finished = True
            return
        reader = self._reader
        if not self._advancing and (reader.queue or reader.broken is not None or reader.backlogged):
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
        self._reader.queue.clear()
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
        started = self._reader.started_at  # when the request being read began arriving
        waiting_on_us = self._exchange is not None or self._lobby is not None or bool(self._reader.queue)
        if started is not None and not waiting_on_us and now - started > self._limits.request_timeout_s:
            return ShedReason.SLOW_REQUEST, IdleTimeout(
                f"the request did not arrive within {self._limits.request_timeout_s:g} s"
            )
        if idle_timeout_s and not self.active and not self._reader.queue and now - self.last_line_at > idle_timeout_s:
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
