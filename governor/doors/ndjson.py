"""Per-connection protocol core: bytes in, reply bytes out. No sockets.

A generate frame takes one path: parse (envelope only) → `Admission.decide` → encode. Refused, it
is answered with a `yield` right here, synchronously: no task, no queue. Admitted, its fields and
integrity are checked and it moves through the lifecycle (lifecycle.py), which its link drives
with the endpoint's answers and which ends it; this door renders what the lifecycle decided
(`worker_token`, `send_*`). The complete lines of a read are answered in slices of at most
`FRAMES_PER_TURN`: the first inside `receive_data`, the rest in later turns of the event loop
(`resume`, which the connection's turn queue calls, see turns.py). A connection whose last
`DEFER_AFTER_REFUSED` frames were all refused answers nothing inside `receive_data`: its frames all
wait for the queue, so a storm of refusals cannot hold the loop while other connections' frames
and the workers' tokens wait. The replies of a slice leave in one write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from time import perf_counter
from typing import Any

from orjson import JSONDecodeError, loads

from governor.accounting import CLIENT_CANCELLED, CLIENT_DISCONNECTED, ShedReason
from governor.admission.appointments.appointment import Appointment
from governor.admission.appointments.lobby import Held
from governor.admission.limits import Grant, Refusal
from governor.doors.shared import admit_and_dispatch, decide_frame, flush_pending
from governor.doors.turns import FRAMES_PER_TURN
from governor.lifecycle import InflightRequest
from governor.state import ServerState
from govwire.auth import AUTH_FRAME_BYTES, auth_candidate, authenticate
from govwire.codec import (
    bad_json,
    encode_accepted,
    encode_authenticated,
    encode_done,
    encode_error,
    encode_pong,
    encode_stats,
    encode_token,
    encode_yield,
    readdress_token,
)
from govwire.errors import (
    DuplicateId,
    FrameTooLarge,
    GovernorError,
    IdleTimeout,
    InternalError,
    RequestRejected,
    TenantMismatch,
    Unauthorized,
)
from govwire.framing import TOO_LARGE, Item, LineSplitter
from govwire.messages import Completion
from govwire.request import checked_request, frame_op
from govwire.vocab import DEFAULT_TENANT, FinishReason, Op

# The logger keeps its name from before the file moved: it is in every log line (logger=governor.ingress).
log = logging.getLogger("governor.ingress")

AUTH_TIMEOUT_S = 10.0  # with auth on, a connection that has not authenticated by then is closed

DEFER_AFTER_REFUSED = 16
"""Refused frames in a row after which a connection's reads wait for the turn queue. A client that
honours its hints is refused a few times at most before it gets in (which resets the count)."""

# Read for every frame: a module global is cheaper than the enum's attribute.
_GENERATE = Op.GENERATE


class Ingress:
    """One client connection's state machine.

    `write` receives the bytes to send (the transport adapter may swap it, see connection.py); the
    adapter owns flow control, and closes the connection once `closing` is set.
    """

    __slots__ = (
        "_state",
        "_ask",
        "_decisions",
        "_decided",
        "_accounting",
        "_lifecycle",
        "_tenants",
        "_tenant_from_frame",
        "tenant",
        "write",
        "_splitter",
        "_max_frame_bytes",
        "_pending",
        "active",
        "authenticated",
        "closing",
        "last_line_at",
        "_opened_at",
        "_held",
        "_refused_in_a_row",
        "_lobby",
        "in_lobby",
    )

    def __init__(self, state: ServerState, write: Callable[[bytes], None], max_frame_bytes: int) -> None:
        self._state = state
        # Bound once: these are called for every frame.
        self._ask = state.costs.ask
        self._decisions = state.latency.admission_decision
        self._decided = 0  # generate frames decided during the current read
        self._accounting = state.accounting
        self._lifecycle = state.lifecycle
        self._tenants = state.admission.tenants
        self._tenant_from_frame = state.tenant_from_frame
        # Whom the connection acts as: decided once, by the secret it authenticated with (the
        # table's tenant of that name is looked up per frame, so a reload changes its limits).
        self.tenant = DEFAULT_TENANT
        self.write = write
        self.authenticated = state.auth is None
        # Until it authenticates, a connection may hold no more than an auth frame needs.
        first_cap = max_frame_bytes if self.authenticated else min(max_frame_bytes, AUTH_FRAME_BYTES)
        self._splitter = LineSplitter(first_cap)
        self._max_frame_bytes = max_frame_bytes
        self._held: list[Item] = []  # complete lines of a read, waiting for their slice (`resume`)
        self._refused_in_a_row = 0  # generate frames refused since the last admitted one
        self._lobby = state.lobby
        self.in_lobby: dict[str, Held] = {}  # client id -> a returning frame held for its capacity
        self._pending: list[bytes] = []
        self.active: dict[str, InflightRequest] = {}  # client id -> request, admitted and unfinished
        self.closing: ShedReason | None = None  # refused: answer nothing more, the adapter sheds the connection
        self._opened_at = state.clock()
        self.last_line_at = state.clock()  # the idle timeout counts from here (blank lines count)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an unfinished frame held for this connection."""
        return self._splitter.buffered_bytes

    # -- client side ------------------------------------------------------------------------------

    @property
    def held_frames(self) -> int:
        """Complete lines of earlier reads waiting for their turn (`resume`)."""
        return len(self._held)

    def receive_data(self, data: bytes) -> None:
        """Answer the read's first slice of frames; the rest, if any, wait for `resume`. A
        connection refused `DEFER_AFTER_REFUSED` times in a row answers nothing here."""
        if self.closing:
            return
        if not self.authenticated:
            data = self._open(data)
        lines = self._splitter.feed(data)
        if self._held or self._refused_in_a_row >= DEFER_AFTER_REFUSED:
            self._held += lines  # (and behind the frames still waiting)
            if self._pending:
                self.flush()  # the reply to an auth frame
        else:
            self._answer(lines, FRAMES_PER_TURN)

    def resume(self, budget: int) -> None:
        """Answer the next `budget` frames held back."""
        lines, self._held = self._held, []
        if lines and not self.closing:
            self._answer(lines, budget)

    def _answer(self, lines: list[Item], budget: int) -> None:
        if len(lines) > budget:
            self._held = lines[budget:]
            lines = lines[:budget]
        # One clock reading per slice serves every frame in it: they are decided together.
        started = perf_counter()
        now = self._state.clock()
        pending = self._pending
        if lines:
            self.last_line_at = now
        self._decided = 0
        for line in lines:
            if self.closing:
                break
            if line is TOO_LARGE:
                pending.append(self._reject(FrameTooLarge(f"frame exceeds {self._splitter.max_frame_bytes} bytes")))
            elif line and line != b"\r":  # blank lines are keep-alives, not frames
                pending.append(self._handle_frame(line, now))
        if self._decided:
            # One sample per decided frame: the time to the read's last decision, an upper bound
            # for each (a clock reading and a histogram update per frame cost more than a decision).
            self._decisions.observe(perf_counter() - started, self._decided)
        if pending:
            self.flush()
        if self.closing:
            self._held = []

    def _handle_frame(self, line: bytes, now: float) -> bytes:
        """Answer one frame."""
        try:
            obj = loads(line)
            op = frame_op(obj)
        except JSONDecodeError as exc:
            return self._reject(bad_json(exc))
        except RequestRejected as exc:
            if type(obj) is dict and obj.get("op") == Op.AUTH:
                return self._authenticate(obj)  # `id` is optional on auth frames
            return self._reject(exc)
        if op is not _GENERATE:
            return self._control(op, obj)
        rid: str = obj["id"]
        if rid in self.active or rid in self.in_lobby:
            return self._reject(DuplicateId(f"id {rid!r} is already in flight on this connection", rid))
        ask = self._ask(obj)
        claimed = obj.get("tenant")
        if self._tenant_from_frame:
            ask.tenant = self._tenants.resolve(claimed)
        elif claimed is None or claimed == self.tenant:
            ask.tenant = self._tenants.resolve(self.tenant)
        else:
            return self._reject(
                TenantMismatch(f"this connection acts as tenant {self.tenant!r} (--tenant-from auth)", rid)
            )
        ticket = obj.get("retry_ticket")
        if type(ticket) is not str:
            ticket = None  # (a ticket of any other shape is none)
        elif ticket:  # the client says it retries (counted apart; a blind one without its appointment)
            ask.retry = True
        ask.ticket = ticket
        prompt = obj.get("prompt")  # re-sent, its id and prompt name the client (None: not a prompt yet)
        ask.resent = (rid, prompt if type(prompt) is str else None)
        ask.identity_unique = True  # an id names one client's request
        return decide_frame(self._state, self, obj, ask, now)

    # -- rendering the decision step's answers (shared.Renderer; the frame: its JSON object) ------

    def render_refusal(self, frame: dict[str, Any], refusal: Refusal) -> bytes:
        """The hot path under overload: decided and encoded in the read that brought the frame,
        written with that read's replies."""
        self._decided += 1
        self._refused_in_a_row += 1
        appointment = refusal.appointment
        if appointment is None:
            return encode_yield(frame["id"], refusal.hint_ms, refusal.reason, None, refusal.final)
        return encode_yield(frame["id"], refusal.hint_ms, refusal.reason, appointment.ticket)

    def render_rejected(self, frame: dict[str, Any], error: RequestRejected) -> bytes:
        error.request_id = frame["id"]
        return self._reject(error)

    def render_admitted(self, frame: dict[str, Any], grant: Grant, now: float, queued_s: float) -> bytes:
        self._decided += 1
        self._refused_in_a_row = 0
        rid = frame["id"]
        admitted = admit_and_dispatch(
            self._lifecycle, self, rid, grant, now, partial(checked_request, frame, self._state.limits)
        )
        if isinstance(admitted, GovernorError):
            return encode_error(admitted, rid)
        return encode_accepted(rid) if admitted[1].ack else b""

    def park(self, frame: dict[str, Any], held: Held) -> None:
        """Parked in the lobby; its answer is written when it comes (the NDJSON door answers by
        id: the frames after it are not held up)."""
        self._decided += 1
        self.in_lobby[frame["id"]] = held

    def answer_held(self, frame: dict[str, Any], reply: bytes) -> None:
        del self.in_lobby[frame["id"]]
        self._pending.append(reply)
        self.flush()

    def _reject(self, exc: RequestRejected) -> bytes:
        self._accounting.frame_rejected(exc.code)
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
            rid, tenant = authenticate(obj, self._state.auth)
        except Unauthorized as exc:
            self.closing = ShedReason.UNAUTHORIZED
            return self._reject(exc)
        if not self.authenticated:
            self.authenticated = True
            self.tenant = tenant
            self._splitter.max_frame_bytes = self._max_frame_bytes
            self.last_line_at = self._state.clock()
            log.debug("event=client_authenticated tenant=%s", tenant)
        elif tenant != self.tenant:  # identity is decided once: a later auth frame cannot switch it
            return self._reject(TenantMismatch(f"this connection acts as tenant {self.tenant!r}", rid))
        return encode_authenticated(rid)

    def _control(self, op: Op, obj: dict[str, Any]) -> bytes:
        if op is Op.PING:
            return encode_pong(obj["id"])
        if op is Op.AUTH:
            return self._authenticate(obj)
        if op is Op.CANCEL:
            # Answered by the request's own final reply (`done`, finish_reason "cancelled", once the
            # worker stops it); a cancel for an id not in flight lost a race with that reply: ignored.
            rid = obj["id"]
            request = self.active.get(rid)
            if request is not None:
                self._lifecycle.cancel(request)
                return b""
            held = self.in_lobby.pop(rid, None)
            if held is not None:  # never ran: its appointment goes back, it is answered now
                self._lobby.leave(held)
                self._accounting.frame_failed(CLIENT_CANCELLED)
                return encode_done(rid, Completion("", 0, 0, FinishReason.CANCELLED, 0.0))
            return b""
        return encode_stats(obj["id"], self._state.snapshot())

    def fail_internal(self) -> None:
        """A bug surfaced while handling this connection's input: send what is ready, count it,
        say so. The caller closes the connection, which settles its in-flight requests.

        The internal error is counted as one more received frame that failed: the frame that hit
        the bug was either already settled (a yield or reject counted before the failure) or is
        in `active` and gets settled on close, so the balance holds either way.
        """
        self._accounting.frame_failed(InternalError.code)
        self._pending.append(encode_error(InternalError("internal error; closing the connection")))
        self.flush()

    def timeout(self, now: float, idle_timeout_s: float) -> tuple[ShedReason, GovernorError | None] | None:
        """Called about once a second: the auth deadline (blank lines do not extend it), then idling."""
        if not self.authenticated and now - self._opened_at > AUTH_TIMEOUT_S:
            return ShedReason.UNAUTHORIZED, Unauthorized(f"no auth frame within {AUTH_TIMEOUT_S:g} s")
        if idle_timeout_s and not self.active and now - self.last_line_at > idle_timeout_s:
            return ShedReason.IDLE, IdleTimeout(f"no frame for {idle_timeout_s:g} s")
        return None

    @staticmethod
    def last_words(error: GovernorError) -> bytes:
        """The reply written when the connection is shed."""
        return encode_error(error)

    def connection_lost(self, reason: str = CLIENT_DISCONNECTED) -> None:
        """The connection is gone (or being shed): free its slots now and tell the worker to stop
        its requests; its frames in the lobby give their appointments back (each counted failed)."""
        self._lifecycle.abandon(self, reason)
        for held in self.in_lobby.values():
            self._lobby.leave(held)
            self._accounting.frame_failed(reason)
        self.in_lobby.clear()
        self._pending.clear()

    # -- rendering what the lifecycle decided (lifecycle.RequestOwner) -----------------------------

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        """A worker's token frame, re-addressed as bytes without parsing it (codec.TOKEN_FRAME_HEAD):
        most of what streaming costs the governor."""
        if request.stream:
            self._pending.append(readdress_token(rest, request.client_id))

    def relay_event(self, request: InflightRequest, text: str, event: bytes, usage: bool, only_usage: bool) -> None:
        """An OpenAI-compatible endpoint's event: its text as a token frame with no token id
        (an event without text renders nothing; the usage comes with `done`)."""
        if text and request.stream:
            self._pending.append(encode_token(request.client_id, request.tokens_seen - 1, None, text))

    def send_done(self, request: InflightRequest, completion: Completion) -> None:
        t_received, t_first = request.t_received, request.t_first_token
        reply = encode_done(
            request.client_id,
            completion,
            total_ms=round((self._state.clock() - t_received) * 1000, 3),
            ttft_ms=None if t_first is None else round((t_first - t_received) * 1000, 3),
        )
        self._pending.append(reply)

    def send_error(self, request: InflightRequest, error: GovernorError) -> None:
        self._pending.append(encode_error(error))

    def send_yield(
        self, request: InflightRequest, retry_hint_ms: int, reason: str, appointment: Appointment | None = None
    ) -> None:
        if appointment is None:
            final = self._state.admission.is_final(reason, retry_hint_ms)
            self._pending.append(encode_yield(request.client_id, retry_hint_ms, reason, None, final))
        else:  # (admission named it by what the client re-sends: its id and prompt)
            self._pending.append(encode_yield(request.client_id, retry_hint_ms, reason, appointment.ticket))

    def flush(self) -> None:
        flush_pending(self._pending, self.write)
