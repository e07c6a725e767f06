"""One admitted request's life, in one file: its phases, every transition, and how it ends.

    ADMITTED ──dispatch──▶ DISPATCHED ──start──▶ STARTED
        │                   │   ▲                   │
        │                   └───┘ reroute           │
        └───────────── settle (any phase) ──────────┴──▶ SETTLED

A request is `ADMITTED` once a `Grant` was charged for it; `DISPATCHED` once a worker link has it;
`STARTED` at its first token (from then on a lost worker means `worker_lost`, since tokens were
already streamed; before it, the request is re-routed once); `SETTLED` at its final reply. A
request with a deadline that is still ADMITTED or DISPATCHED when it passes `expire`s: the worker
is told to cancel it and it settles at once with `deadline_exceeded`. Every release of capacity,
every settlement of a token cost, every count of an admitted request's fate and every latency
observation happens in these transitions, so "exactly one final reply, its slots released exactly once" is
read here (h11 keeps its state machine in one file for the same reason). A transition from the
wrong phase is a bug and raises `LifecycleError`: it never frees a slot twice. Each transition that
moves capacity calls its counterpart in `Admission`: start → `started`, reroute → `reroute`,
refuse → `refund`, settle → `release`, expire → `expired`.

**Endings.** Which final reply a request gets is decided here, once for every door: the links
call `finish` (the endpoint's `done`), `fail` (an error), `busy` (the endpoint was full before it
started: re-routed once, else a late `endpoint_busy` yield) and `lose` (the endpoint was lost:
re-routed once before the first token, else `worker_lost`); a missed deadline `expire`s (a `fail`);
a request a higher class displaces before its first token is `evict`ed (a late `preempted` yield).
Each settles first, then asks the request's owner (a door) to render the reply (`send_done`,
`send_error`, `send_yield`): the doors render and never choose. A closed connection is `abandon`ed:
its requests are settled and nothing is rendered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Protocol, cast

from governor.accounting import ENDPOINT_FAILURES, Accounting, DeadlineOutcome, Outcome, outcome_of
from governor.admission.cost import Ask, CostModel
from governor.admission.decision import Admission
from governor.admission.displacement import Answer, Displace
from governor.admission.limits import Grant, Refusal
from governor.latency import LatencyMetrics
from governor.timers import Cancellable, Timers
from govwire.errors import DeadlineExceeded, GovernorError, RequestRejected, WorkerLost, WorkerUnavailable
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import YieldReason

if TYPE_CHECKING:
    from governor.admission.appointments.appointment import Appointment

log = logging.getLogger("governor.lifecycle")


class Phase(Enum):
    ADMITTED = "admitted"
    DISPATCHED = "dispatched"
    STARTED = "started"
    SETTLED = "settled"


# The transitions run for every request and token: module globals are read in a few ns, an
# enum's members through its class in ~75 (CPython 3.11).
_ADMITTED, _DISPATCHED, _STARTED, _SETTLED = Phase.ADMITTED, Phase.DISPATCHED, Phase.STARTED, Phase.SETTLED
_EXECUTED, _FAILED, _YIELDED = Outcome.EXECUTED, Outcome.FAILED, Outcome.YIELDED
_ENDPOINT_BUSY = YieldReason.ENDPOINT_BUSY.value
_PREEMPTED = YieldReason.PREEMPTED.value


class LifecycleError(RuntimeError):
    """A transition was asked for in a phase that does not allow it."""


class RequestOwner(Protocol):
    """The client connection an admitted request answers to (a door: the NDJSON `Ingress` or the
    HTTP `HttpIngress`). It only renders: the lifecycle has settled a request before it asks for
    its final reply, and has counted a token (`token`) before it is rendered. Whoever made it
    render calls `flush` once it is done: a worker link after each read, the OpenAI link after
    each read or ending, a deadline's timer, the drain."""

    active: dict[str, InflightRequest]

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        """A worker's token frame, `rest` being its bytes after the id (codec.TOKEN_FRAME_HEAD):
        the hot path, re-addressed as bytes by the NDJSON door."""

    def relay_event(self, request: InflightRequest, text: str, event: bytes, usage: bool, only_usage: bool) -> None:
        """One server-sent event of an OpenAI-compatible endpoint's stream: `event` its data as the
        endpoint sent it, `text` the text it carries (already counted in `request.tokens_seen`; ""
        for a role, finish or usage chunk), `usage` whether it carries the usage counts and
        `only_usage` whether that is all it carries. The HTTP door relays the bytes to a client
        that speaks the same format; the NDJSON door renders the text."""

    def send_done(self, request: InflightRequest, completion: Completion) -> None:
        """Its final reply: executed."""

    def send_error(self, request: InflightRequest, error: GovernorError) -> None:
        """Its final reply: failed, or rejected by its endpoint."""

    def send_yield(
        self, request: InflightRequest, retry_hint_ms: int, reason: str, appointment: Appointment | None = None
    ) -> None:
        """Its final reply: a yield after admission (its endpoint was full before it started, or
        a higher class displaced it); with the appointment kept for its return, if one was booked
        (the door recognises the client by what it re-sends, and renders the ticket)."""

    def flush(self) -> None: ...


class Link(Protocol):
    """A link as a request sees it (links/worker_link.py, links/openai_link.py): the requests it
    holds, by uid."""

    inflight: dict[str, InflightRequest]

    def cancel(self, uid: str) -> None: ...


class Dispatcher(Protocol):
    """Where admitted requests go (links/upstream.py): it picks the link of the request's endpoint."""

    def dispatch(self, request: InflightRequest, generate: GenerateRequest) -> None:
        """Send it; sets `request.link` and `request.uid`, or raises `WorkerUnavailable`."""

    def forget(self, request: InflightRequest) -> None:
        """Stop routing the link's replies for it (they may still arrive)."""

    def cancel(self, request: InflightRequest) -> None:
        """Ask its worker to stop it; the worker answers with its final reply."""


class InflightRequest:
    """What the governor keeps for one admitted request; dropped at its final reply."""

    __slots__ = (
        "client_id",
        "uid",
        "stream",
        "owner",
        "grant",
        "link",
        "generate",
        "t_received",
        "t_first_token",
        "t_last_token",
        "tokens_seen",
        "deadline_timer",
        "phase",
    )

    def __init__(self, client_id: str, owner: RequestOwner, grant: Grant, t_received: float) -> None:
        self.client_id = client_id
        self.owner = owner
        self.grant = grant  # what admission charged for it: its endpoint, among others
        self.uid = ""  # assigned on dispatch; unique over all connections (client ids are not)
        self.stream = True
        self.link: Link | None = None  # the worker link holding it, set by the dispatcher
        self.generate: GenerateRequest | None = None  # kept until it starts, to re-route it once
        self.t_received = t_received
        self.t_first_token: float | None = None
        self.t_last_token = 0.0  # when its latest token came (the release forecast times it from it)
        self.tokens_seen = 0  # token frames from the worker (what it generated, if no done comes)
        self.deadline_timer: Cancellable | None = None
        self.phase = _ADMITTED


class Lifecycle:
    """The transitions. `settle` is the only place an admitted request's capacity is released."""

    __slots__ = ("_admission", "_accounting", "_latency", "_dispatcher", "_clock", "_costs", "_timers", "_freed")

    def __init__(
        self,
        admission: Admission,
        accounting: Accounting,
        latency: LatencyMetrics,
        dispatcher: Dispatcher,
        clock: Callable[[], float],
        costs: CostModel,
        timers: Timers,
        freed: Callable[[], None] = lambda: None,
    ) -> None:
        self._admission = admission
        self._accounting = accounting
        self._latency = latency
        self._dispatcher = dispatcher
        self._clock = clock
        self._costs = costs
        self._timers = timers
        self._freed = freed  # told after every release of capacity (the lobby: admission/appointments/lobby.py)

    def decide(self, now: float, ask: Ask) -> Grant | Refusal:
        """Admission's decision on `ask`, carried out where it is a displacement (`displace`).
        Raises `OverBudget` as `decide` does."""
        decision = self._admission.decide(now, ask)
        if type(decision) is Displace:
            return self.displace(now, ask, decision)
        return cast("Grant | Refusal", decision)

    def displace(self, now: float, ask: Ask, displace: Displace) -> Grant | Refusal:
        """Admission answered that `ask` may take a lower class's slot: the victim is settled
        (`evict`: its capacity is back), the frame decided again on what it freed, and the
        victim's client told its hint once that is booked."""
        answer = self.evict(displace.victim)
        decided, hint_ms, appointment = self._admission.after_displacing(now, ask, displace)
        answer(hint_ms, appointment)
        return decided

    def admit(self, owner: RequestOwner, client_id: str, grant: Grant, now: float) -> InflightRequest:
        """Register a request `decide` granted. From here on whatever happens to it ends in `settle`
        (its final reply, or its connection's loss), so its slots are never stranded."""
        self._accounting.frame_admitted(grant.ask)
        request = InflightRequest(client_id, owner, grant, now)
        grant.progress = request  # the release forecast reads its stream (until `settle`)
        owner.active[client_id] = request
        deadline = grant.ask.deadline_s
        if deadline is not None:
            request.deadline_timer = self._timers.call_later(deadline, self.expire, request)
        return request

    def dispatch(self, request: InflightRequest, generate: GenerateRequest) -> None:
        """ADMITTED → DISPATCHED; `WorkerUnavailable` leaves it ADMITTED (the caller settles it)."""
        _expect(request, _ADMITTED, "dispatch")
        request.stream = generate.stream
        self._dispatcher.dispatch(request, generate)
        request.generate = generate
        request.phase = _DISPATCHED

    def token(self, request: InflightRequest) -> None:
        """A token (or a piece of streamed text) for it arrived: counted; the first starts it.
        (The worker link's byte path does the same two steps inline.)"""
        request.tokens_seen += 1
        if request.phase is not _STARTED:
            self.start(request)  # times it as its first and latest token
        else:
            request.t_last_token = self._clock()

    def start(self, request: InflightRequest) -> None:
        """DISPATCHED → STARTED at its first token."""
        _expect(request, _DISPATCHED, "start")
        request.phase = _STARTED
        request.generate = None
        now = request.t_first_token = request.t_last_token = self._clock()
        ttft = now - request.t_received
        self._latency.time_to_first_token.observe(ttft)
        self._admission.started(request.grant, ttft, now)
        if request.deadline_timer is not None:
            request.deadline_timer.cancel()
            request.deadline_timer = None
            self._accounting.deadline(DeadlineOutcome.MET, request.grant.predicted_ttft_s, ttft)

    def reroute(self, request: InflightRequest) -> bool:
        """DISPATCHED → DISPATCHED on another endpoint, once, after its worker was lost before the
        first token. Nothing was streamed, so the client cannot tell; it keeps its global slot and
        charge. False (and no change) when it started, was re-routed already, or nowhere can take it."""
        generate = request.generate
        if request.phase is not _DISPATCHED or generate is None:
            return False
        request.generate = None  # once
        admission = self._admission
        old_endpoint = request.grant.endpoint
        if not admission.reroute(request.grant, self._clock()):
            return False
        self._dispatcher.forget(request)
        request.phase = _ADMITTED
        try:
            self.dispatch(request, generate)
        except (WorkerUnavailable, RequestRejected):  # down, or a kind that cannot take it (chat, top_k)
            admission.refund_reroute(request.grant)
            return False  # still ADMITTED: the caller settles it, which frees the new endpoint's slot
        request.generate = None
        self._accounting.request_rerouted()
        new_endpoint = request.grant.endpoint
        log.info(
            "event=rerouted id=%r tenant=%s from=%s to=%s",
            request.client_id,
            request.grant.ask.tenant.name if request.grant.ask.tenant is not None else None,
            old_endpoint.name if old_endpoint is not None else None,
            new_endpoint.name if new_endpoint is not None else None,
        )
        return True

    def refuse(self, request: InflightRequest, outcome: Outcome, reason: str) -> None:
        """ADMITTED → SETTLED without reaching a worker (invalid once admitted, or no worker up):
        what admission charged is refunded, its slots released."""
        _expect(request, _ADMITTED, "refuse")
        self._admission.refund(request.grant)
        self.settle(request, outcome, reason)

    def cancel(self, request: InflightRequest) -> None:
        """Ask the worker to stop it; no phase change: its final reply settles it."""
        if request.phase is _DISPATCHED or request.phase is _STARTED:
            self._dispatcher.cancel(request)

    def expire(self, request: InflightRequest) -> None:
        """Its deadline passed before its first token (the timer `admit` set): the worker is told
        to stop it and it fails with `deadline_exceeded` now, so its slot and tokens return now.
        The worker's own final reply for it, arriving later, is dropped."""
        request.deadline_timer = None
        if request.phase is not _ADMITTED and request.phase is not _DISPATCHED:
            return  # started or settled since the timer was set
        waited = self._clock() - request.t_received
        self._accounting.deadline(DeadlineOutcome.EXPIRED, request.grant.predicted_ttft_s, waited)
        self._admission.expired(request.grant, waited)
        self.cancel(request)
        deadline_ms = round(request.grant.ask.deadline_s * 1000) if request.grant.ask.deadline_s else 0
        self.fail(request, DeadlineExceeded(f"no first token within deadline_ms {deadline_ms}", request.client_id))
        request.owner.flush()  # a timer fired: no read will flush it

    # -- endings: each settles, then the owner renders ---------------------------------------------

    def finish(self, request: InflightRequest, completion: Completion) -> None:
        """Its endpoint's final answer: executed."""
        self.settle(request, _EXECUTED, completion=completion)
        request.owner.send_done(request, completion)

    def fail(self, request: InflightRequest, error: GovernorError) -> None:
        """It ends in `error`: rejected when the frame was at fault, failed otherwise."""
        self.settle(request, outcome_of(error), error.code)
        request.owner.send_error(request, error)

    def busy(self, request: InflightRequest, retry_hint_ms: int) -> None:
        """Its endpoint refused it as full before starting it (an OpenAI-compatible server's
        429/503): re-routed once, else answered with a late yield. The endpoint is paused for
        that long (its link): when the pause ends its capacity is back, and the lobby is told."""
        self._timers.call_later(retry_hint_ms / 1000.0, self._freed)
        if self.reroute(request):
            return
        self.settle(request, _YIELDED, _ENDPOINT_BUSY)
        self._latency.retry_hint(_ENDPOINT_BUSY, retry_hint_ms)
        request.owner.send_yield(request, retry_hint_ms, _ENDPOINT_BUSY)

    def evict(self, grant: Grant) -> Answer:
        """Displaced by a higher class before its first token (admission/displacement.py): told
        to stop in its worker and settled now as a yield `preempted`, so its slot is free for the
        newcomer in the same turn. Its client is answered by the returned callable once admission
        has booked its hint (after the newcomer was charged), on the next turn of the loop: never
        inside the decision that displaced it."""
        request = grant.progress
        assert isinstance(request, InflightRequest)  # (every admitted grant's, until it settles)
        self.cancel(request)
        self.settle(request, _YIELDED, _PREEMPTED)

        def answer(retry_hint_ms: int, appointment: Appointment | None) -> None:
            self._latency.retry_hint(_PREEMPTED, retry_hint_ms)
            self._timers.call_later(0.0, self._answer_preempted, request, retry_hint_ms, appointment)

        return answer

    @staticmethod
    def _answer_preempted(request: InflightRequest, retry_hint_ms: int, appointment: Appointment | None) -> None:
        request.owner.send_yield(request, retry_hint_ms, _PREEMPTED, appointment)
        request.owner.flush()  # a timer fired: no read will flush it

    def lose(self, request: InflightRequest, message: str) -> None:
        """Its endpoint was lost (the link dropped, or would not confirm a cancel): re-routed once
        if it had not started, else `worker_lost`. Either way a failure of the endpoint it was on."""
        lost_at = request.grant.endpoint
        if lost_at is not None:
            lost_at.ended(executed=False)
        if not self.reroute(request):
            self.fail(request, WorkerLost(message, request.client_id))

    def abandon(self, owner: RequestOwner, reason: str) -> None:
        """Its connection is gone (or being shed): every request it holds is cancelled in its
        worker and settled now, its slots freed. Nothing is rendered: nobody is there to read it."""
        for request in list(owner.active.values()):
            self.cancel(request)
            self.settle(request, _FAILED, reason)

    def settle(
        self, request: InflightRequest, outcome: Outcome, reason: str = "", completion: Completion | None = None
    ) -> None:
        """Any phase → SETTLED, exactly once: free its capacity, count its fate, forget it everywhere."""
        if request.phase is _SETTLED:
            raise LifecycleError(f"request {request.client_id!r} settled twice ({outcome.value} {reason})")
        reached_worker = request.phase is not _ADMITTED
        request.phase = _SETTLED
        if request.deadline_timer is not None:
            request.deadline_timer.cancel()
            request.deadline_timer = None
        grant = request.grant
        if completion is not None:
            grant.used = self._costs.settle(grant.ask, completion.prompt_tokens, completion.completion_tokens)
        elif reached_worker:  # no counts from the worker: its prompt as estimated, and what it streamed
            grant.used = self._costs.cost_of(grant.ask.prompt_tokens, request.tokens_seen)
        else:
            grant.used = 0  # it never ran
        now = self._clock()
        executed = outcome is _EXECUTED
        endpoint = grant.endpoint
        if endpoint is not None and reached_worker and (executed or reason in ENDPOINT_FAILURES):
            endpoint.ended(executed)
        self._admission.release(grant, executed, now)
        self._freed()
        grant.progress = None
        self._accounting.request_settled(grant.ask, outcome, reason, grant.used)
        request.owner.active.pop(request.client_id, None)
        if not reached_worker:
            return  # invalid after admission, or no worker: no duration
        self._dispatcher.forget(request)
        latency = self._latency
        if completion is not None:
            latency.queue_wait.observe(completion.queue_wait_ms / 1000)
        elapsed = now - request.t_received
        latency.request_duration.observe(elapsed)
        if outcome is _EXECUTED:
            self._admission.hints.observe_service_time(elapsed)


def _expect(request: InflightRequest, phase: Phase, transition: str) -> None:
    if request.phase is not phase:
        raise LifecycleError(
            f"{transition} of request {request.client_id!r} in phase {request.phase.value} (needs {phase.value})"
        )
