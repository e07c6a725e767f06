"""What both doors (the NDJSON port and the HTTP front door) do the same way: the decision step
from a parsed frame to its answer, the step from a grant to a dispatched request, and how one
read's replies leave.

A door parses (the envelope, the cost, who asks and what it would re-send) and renders; what
happens between is `decide_frame`, written once: admission's decision, a request no budget can
hold, a returning client parked in the lobby, a refusal counted and hinted, a grant admitted. The
door renders each answer through its `Renderer`, the way `lifecycle.RequestOwner` renders what the
lifecycle decided. The yield path stays in the read that brought the frame: decided and encoded
inline, written with that read's replies.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, TypeVar, cast

from governor.accounting import outcome_of
from governor.admission.appointments.books import HOLD
from governor.admission.appointments.lobby import Held
from governor.admission.cost import Ask
from governor.admission.displacement import Displace
from governor.admission.limits import Grant, Refusal
from governor.lifecycle import InflightRequest, Lifecycle, RequestOwner
from governor.state import ServerState
from govwire.errors import RequestRejected, WorkerUnavailable
from govwire.request import GenerateRequest

F = TypeVar("F", contravariant=True)


class Renderer(Protocol[F]):
    """What a door renders of the decision step's answers for one frame (`F`: the door's parsed
    frame, handed back as it was given)."""

    def render_refusal(self, frame: F, refusal: Refusal) -> bytes:
        """A yield (counted and hinted already): its hint, its ticket if an appointment was booked."""

    def render_rejected(self, frame: F, error: RequestRejected) -> bytes:
        """A request no wait would let in (`OverBudget`), or one a reload's lower caps refused
        while it was held: the door counts it rejected."""

    def render_admitted(self, frame: F, grant: Grant, now: float, queued_s: float) -> bytes:
        """Admitted: checked, dispatched (`admit_and_dispatch`), its response begun; `queued_s`:
        how long it was held in the lobby."""

    def park(self, frame: F, held: Held) -> None:
        """Held in the lobby: the door keeps `held` (to give it back if its client goes)."""

    def answer_held(self, frame: F, reply: bytes) -> None:
        """A held frame's answer, rendered: a timer or another request's end brought it, so no
        read will write it."""


def decide_frame(state: ServerState, door: Renderer[F], frame: F, ask: Ask, now: float) -> bytes:
    """The one decision step of both doors: decide `ask` now and render the answer (b"" when it
    comes later: held in the lobby, or an admitted request's response)."""
    try:
        decision = state.admission.decide(now, ask)
        if type(decision) is Displace:  # a lower class gives way: the lifecycle carries it out
            decision = state.lifecycle.displace(now, ask, decision)
    except RequestRejected as exc:  # OverBudget: no wait would let it in
        return door.render_rejected(frame, exc)
    if type(decision) is Refusal:
        appointment = decision.appointment
        if decision.hint_ms == HOLD and appointment is not None:  # back for its appointment, not free yet
            door.park(frame, state.lobby.hold(ask, appointment, partial(_answer_held, state, door, frame, ask)))
            return b""
        # The hot path under overload: counted, its hint recorded, rendered in the read that brought it.
        state.accounting.frame_yielded(decision.reason, ask, decision.final)
        state.latency.retry_hint(decision.reason, decision.hint_ms)
        return door.render_refusal(frame, decision)
    return door.render_admitted(frame, cast(Grant, decision), now, 0.0)


def _answer_held(
    state: ServerState, door: Renderer[F], frame: F, ask: Ask, decision: Grant | Refusal | RequestRejected, since: float
) -> None:
    """The lobby decided a held frame (lobby.Answer): rendered as it would have been at once."""
    if isinstance(decision, RequestRejected):
        reply = door.render_rejected(frame, decision)
    elif type(decision) is Refusal:  # (counted as decide_frame counts a refusal)
        state.accounting.frame_yielded(decision.reason, ask, decision.final)
        state.latency.retry_hint(decision.reason, decision.hint_ms)
        reply = door.render_refusal(frame, decision)
    else:
        now = state.clock()
        reply = door.render_admitted(frame, cast(Grant, decision), now, now - since)
    door.answer_held(frame, reply)


def admit_and_dispatch(
    lifecycle: Lifecycle,
    owner: RequestOwner,
    request_id: str,
    grant: Grant,
    now: float,
    check: Callable[[], GenerateRequest],
) -> tuple[InflightRequest, GenerateRequest] | RequestRejected | WorkerUnavailable:
    """Register a granted frame, check it (`check` builds its generate request: every field, its
    integrity) and dispatch it. A frame that fails its checks, or that no endpoint can take, is
    refused (what admission charged comes back, its slot is freed) and the error returned for
    the door to render; only the envelope and the cost were read before the grant, so refusing
    stays cheap whatever the frame holds."""
    request = lifecycle.admit(owner, request_id, grant, now)
    try:
        generate = check()
        lifecycle.dispatch(request, generate)
    except (RequestRejected, WorkerUnavailable) as exc:
        lifecycle.refuse(request, outcome_of(exc), exc.code)
        return exc
    return request, generate


def flush_pending(pending: list[bytes], write: Callable[[bytes], None]) -> None:
    """Write what a read (or a link's callback) produced, in one write, and forget it."""
    if pending:
        data = b"".join(pending)
        pending.clear()
        if data:
            write(data)
