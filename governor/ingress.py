"""Per-connection protocol core: bytes in, decisions and reply bytes out. No sockets.

Every complete line is answered inside the same `receive_data` call, and all replies produced by
one read leave in one write. A yield is decided here, synchronously: no task, no queue.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from time import perf_counter
from typing import Any

from orjson import JSONDecodeError, loads

from governor.accounting import CLIENT_DISCONNECTED, YIELD_DRAINING, YIELD_INFLIGHT, Outcome
from governor.auth import AUTH_FRAME_BYTES, auth_candidate, authenticate
from governor.errors import (
    DuplicateId,
    FrameTooLarge,
    GovernorError,
    InternalError,
    RequestRejected,
    Unauthorized,
    WorkerLost,
    WorkerUnavailable,
    error_from_code,
)
from governor.framing import TOO_LARGE, LineSplitter
from governor.pool import Endpoint, Refusal
from governor.state import InflightRequest, ServerState
from governor.validation import OP_AUTH, OP_CANCEL, OP_GENERATE, OP_PING, checked_request, frame_op
from governor.wire import (
    STATUS_DONE,
    STATUS_ERROR,
    STATUS_STATS,
    STATUS_TOKEN,
    bad_json,
    encode,
    encode_accepted,
    encode_authenticated,
    encode_error,
    encode_pong,
    encode_yield,
    readdress_token,
)

log = logging.getLogger("governor.ingress")


class Ingress:
    """One client connection's state machine.

    `write` receives the bytes to send (the transport adapter may swap it, see protocol.py); the
    adapter owns flow control, and closes the connection once `closing` is set.
    """

    __slots__ = (
        "_state",
        "write",
        "_splitter",
        "_max_frame_bytes",
        "_pending",
        "active",
        "authenticated",
        "closing",
        "last_line_at",
    )

    def __init__(self, state: ServerState, write: Callable[[bytes], None], max_frame_bytes: int) -> None:
        self._state = state
        self.write = write
        self.authenticated = state.auth is None
        # Until it authenticates, a connection may hold no more than an auth frame needs.
        first_cap = max_frame_bytes if self.authenticated else min(max_frame_bytes, AUTH_FRAME_BYTES)
        self._splitter = LineSplitter(first_cap)
        self._max_frame_bytes = max_frame_bytes
        self._pending: list[bytes] = []
        self.active: dict[str, InflightRequest] = {}  # client id -> request, admitted and unfinished
        self.closing = False  # refused: answer nothing more, the adapter closes the connection
        self.last_line_at = state.clock()  # the idle timeout counts from here (blank lines count)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an unfinished frame held for this connection."""
        return self._splitter.buffered_bytes

    # -- client side ------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        # One clock reading per read serves every frame it completes: they arrived together.
        if self.closing:
            return
        started = perf_counter()
        now = self._state.clock()
        if not self.authenticated:
            data = self._open(data)
        pending = self._pending
        lines = self._splitter.feed(data)
        if lines:
            self.last_line_at = now
        for line in lines:
            if self.closing:
                break
            if line is TOO_LARGE:
                pending.append(self._reject(FrameTooLarge(f"frame exceeds {self._splitter.max_frame_bytes} bytes")))
            elif line and line != b"\r":  # blank lines are keep-alives, not frames
                pending.append(self._handle_frame(line, now, started))
        if pending:
            self.flush()

    def _handle_frame(self, line: bytes, now: float, started: float) -> bytes:
        """Answer one frame; `started` (perf_counter) is when its read began, for the decision latency."""
        state = self._state
        try:
            obj = loads(line)
            op = frame_op(obj)
        except JSONDecodeError as exc:
            return self._reject(bad_json(exc))
        except RequestRejected as exc:
            if type(obj) is dict and obj.get("op") == OP_AUTH:
                return self._authenticate(obj)  # `id` is optional on auth frames
            return self._reject(exc)
        if op != OP_GENERATE:
            return self._control(op, obj)
        rid: str = obj["id"]
        if rid in self.active:
            return self._reject(DuplicateId(f"id {rid!r} is already in flight on this connection", rid))
        accounting = state.accounting
        accounting.received += 1
        decisions = state.latency.admission_decision
        if state.draining or not state.limiter.try_acquire():
            # The hot path under overload: decided and encoded here, written with this read's replies.
            reason = YIELD_DRAINING if state.draining else YIELD_INFLIGHT
            accounting.yielded[reason] += 1
            reply = encode_yield(rid, state.hints.hint_ms(now), reason)
            decisions.observe(perf_counter() - started)
            return reply
        endpoint = state.pool.reserve(now)
        if isinstance(endpoint, Refusal):
            state.limiter.release()  # nothing else was charged
            accounting.yielded[endpoint.reason] += 1
            wait_s = endpoint.wait_s
            hint = state.hints.hint_ms(now) if wait_s is None else max(1, math.ceil(wait_s * 1000))
            decisions.observe(perf_counter() - started)
            return encode_yield(rid, hint, endpoint.reason)
        decisions.observe(perf_counter() - started)
        return self._admit(obj, rid, now, endpoint)

    def _admit(self, obj: dict[str, Any], rid: str, now: float, endpoint: Endpoint | None) -> bytes:
        state = self._state
        # Registered before anything can fail: whatever happens next, the slots are released by
        # `finish` below, by the worker's final reply, or by `connection_lost` — never stranded.
        request = InflightRequest(rid, True, self, now, endpoint)
        self.active[rid] = request
        try:
            generate = checked_request(obj, state.limits)
            request.stream = generate.stream
            state.upstream.dispatch(request, generate)
            request.generate = generate
        except (RequestRejected, WorkerUnavailable) as exc:
            if endpoint is not None:
                state.pool.refund(endpoint)  # the tokens; `finish` frees the slots at once
            outcome = Outcome.REJECTED if isinstance(exc, RequestRejected) else Outcome.FAILED
            state.finish(request, outcome, exc.code)
            return encode_error(exc, rid)
        return encode_accepted(rid) if generate.ack else b""

    def _reject(self, exc: RequestRejected) -> bytes:
        acc = self._state.accounting
        acc.received += 1
        acc.record(Outcome.REJECTED, exc.code)
        return encode_error(exc)

    def _open(self, data: bytes) -> bytes:
        """Before authentication lines are read one at a time, under the small cap: the first frame
        must be a matching `auth`, anything else closes the connection. Returns the bytes after
        the auth frame, read like any others (pipelined frames may follow it in the same write)."""
        while data:
            nl = data.find(b"\n")
            head, data = (data, b"") if nl < 0 else (data[: nl + 1], data[nl + 1 :])
            for line in self._splitter.feed(head):
                if line is not TOO_LARGE and line in (b"", b"\r"):
                    continue
                self._pending.append(self._authenticate(auth_candidate(line)))
                return data if self.authenticated else b""
        return b""

    def _authenticate(self, obj: Any) -> bytes:
        try:
            rid = authenticate(obj, self._state.auth)
        except Unauthorized as exc:
            self.closing = True
            return self._reject(exc)
        if not self.authenticated:
            self.authenticated = True
            self._splitter.max_frame_bytes = self._max_frame_bytes
            self.last_line_at = self._state.clock()
        return encode_authenticated(rid)

    def _control(self, op: str, obj: dict[str, Any]) -> bytes:
        if op == OP_PING:
            return encode_pong(obj["id"])
        if op == OP_AUTH:
            return self._authenticate(obj)
        if op == OP_CANCEL:
            # Answered by the request's own final reply (`done`, finish_reason "cancelled", once the
            # worker stops it); a cancel for an id not in flight lost a race with that reply: ignored.
            request = self.active.get(obj["id"])
            if request is not None:
                self._state.upstream.cancel(request)
            return b""
        body = self._state.snapshot()
        body["id"] = obj["id"]
        body["status"] = STATUS_STATS
        return encode(body)

    def fail_internal(self) -> None:
        """A bug surfaced while handling this connection's input: send what is ready, count it,
        say so. The caller closes the connection, which settles its in-flight requests.

        The internal error is counted as one more received frame that failed: the frame that hit
        the bug was either already settled (a yield or reject counted before the failure) or is
        in `active` and gets settled on close, so the balance holds either way.
        """
        acc = self._state.accounting
        acc.received += 1
        acc.record(Outcome.FAILED, InternalError.code)
        self._pending.append(encode_error(InternalError("internal error; closing the connection")))
        self.flush()

    def connection_lost(self, reason: str = CLIENT_DISCONNECTED) -> None:
        """The connection is gone (or being shed): free its slots now and tell the worker to stop
        its requests."""
        state = self._state
        for request in list(self.active.values()):
            state.upstream.cancel(request)
            state.finish(request, Outcome.FAILED, reason)
        self._pending.clear()

    # -- worker side ------------------------------------------------------------------------------

    def worker_frame(self, request: InflightRequest, frame: dict[str, Any]) -> None:
        """A token, done or error frame from the worker, re-addressed to the client's id."""
        state = self._state
        status = frame.get("status")
        if status == STATUS_TOKEN:
            self._started(request)
            if request.stream:
                frame["id"] = request.client_id
                self._pending.append(encode(frame))
            return
        if status == STATUS_DONE:
            now = state.clock()
            frame["id"] = request.client_id
            frame["total_ms"] = round((now - request.t_received) * 1000, 3)
            if request.t_first_token is not None:
                frame["ttft_ms"] = round((request.t_first_token - request.t_received) * 1000, 3)
            queue_ms = frame.get("queue_wait_ms")
            if isinstance(queue_ms, int | float):
                state.latency.queue_wait.observe(queue_ms / 1000)
            state.finish(request, Outcome.EXECUTED)
            self._pending.append(encode(frame))
            return
        if status == STATUS_ERROR:
            error = error_from_code(str(frame.get("code")), str(frame.get("message", "")), request.client_id)
        else:
            log.warning("event=worker_protocol_error status=%r", status)
            error = error_from_code("internal", f"worker sent an unknown status {status!r}", request.client_id)
        self._settle_error(request, error)

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        """A token frame the link recognised without parsing it (see wire.TOKEN_FRAME_HEAD):
        re-addressed as bytes, which is most of what streaming costs the governor."""
        self._started(request)
        if request.stream:
            self._pending.append(readdress_token(rest, request.client_id))

    def _started(self, request: InflightRequest) -> None:
        if request.t_first_token is None:
            state = self._state
            request.t_first_token = state.clock()
            state.latency.time_to_first_token.observe(request.t_first_token - request.t_received)
        request.generate = None  # started: a lost worker now means worker_lost, not a re-route

    def worker_lost(self, request: InflightRequest, message: str) -> None:
        if not self._reroute(request):
            self._settle_error(request, WorkerLost(message, request.client_id))

    def _reroute(self, request: InflightRequest) -> bool:
        """Move a request whose worker was lost before its first token to another endpoint, once.
        Nothing was streamed, so the client cannot tell; it keeps its global slot and token, and
        takes a new endpoint slot (and endpoint token)."""
        state = self._state
        generate, request.generate = request.generate, None
        if generate is None or request.t_first_token is not None or state.draining:
            return False
        endpoint = state.pool.reserve(state.clock(), charge_global=False)
        if not isinstance(endpoint, Endpoint):
            return False
        old_link, old_endpoint = request.link, request.endpoint
        if old_link is not None:
            old_link.inflight.pop(request.uid, None)
        if old_endpoint is not None:
            state.pool.release(old_endpoint, executed=False)
        request.endpoint = endpoint
        try:
            state.upstream.dispatch(request, generate)
        except WorkerUnavailable:
            state.pool.refund(endpoint, charge_global=False)
            return False  # `finish` frees the new endpoint's slot with the failure
        state.rerouted += 1
        old_name = old_endpoint.name if old_endpoint is not None else None
        log.info("event=rerouted id=%r from=%s to=%s", request.client_id, old_name, endpoint.name)
        return True

    def _settle_error(self, request: InflightRequest, error: GovernorError) -> None:
        outcome = Outcome.REJECTED if isinstance(error, RequestRejected) else Outcome.FAILED
        self._state.finish(request, outcome, error.code)
        self._pending.append(encode_error(error))

    def flush(self) -> None:
        pending = self._pending
        if pending:
            data = b"".join(pending)
            pending.clear()
            if data:
                self.write(data)
