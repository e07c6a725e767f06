"""How an admitted request ends (lifecycle.py): every ending settles it once, then asks its owner to
render once; `busy` and `lose` re-route it once before its first token; `abandon` renders nothing."""

from __future__ import annotations

from typing import Any

import pytest

from governor.accounting import CLIENT_DISCONNECTED
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.limits import Grant
from governor.lifecycle import InflightRequest, LifecycleError, Phase
from governor.state import ServerState
from govwire.errors import BadFrame, DeadlineExceeded, GovernorError, InternalError
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason
from tests.fakes import FakeClock, FakeTimers, FakeUpstream, make_state


class Owner:
    """A door that records what it is asked to render, and each request's phase when it was."""

    def __init__(self) -> None:
        self.active: dict[str, InflightRequest] = {}
        self.rendered: list[tuple[Any, ...]] = []
        self.phases: list[Phase] = []
        self.flushes = 0

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        self.rendered.append(("token", rest))

    def relay_event(self, request: InflightRequest, text: str, event: bytes, usage: bool, only_usage: bool) -> None:
        self.rendered.append(("text", text))

    def send_done(self, request: InflightRequest, completion: Completion) -> None:
        self._final(request, ("done", completion.finish_reason))

    def send_error(self, request: InflightRequest, error: GovernorError) -> None:
        self._final(request, ("error", error.code))

    def send_yield(self, request: InflightRequest, retry_hint_ms: int, reason: str) -> None:
        self._final(request, ("yield", reason, retry_hint_ms))

    def _final(self, request: InflightRequest, reply: tuple[Any, ...]) -> None:
        # Settled before it is rendered: an HTTP door answers its next pipelined request from
        # inside the rendering, and that request must find this one's slot free.
        self.phases.append(request.phase)
        self.rendered.append(reply)

    def flush(self) -> None:
        self.flushes += 1


def two_endpoints(clock: FakeClock) -> list[Endpoint]:
    endpoints = [Endpoint(name, EndpointLimits(), clock()) for name in ("a", "b")]
    for endpoint in endpoints:
        endpoint.up = True
    return endpoints


def admitted(state: ServerState, owner: Owner, rid: str = "r", deadline_ms: int | None = None) -> InflightRequest:
    """A request through the same steps as a door's: decide, admit, dispatch."""
    ask = state.costs.ask({"prompt": "hi", "deadline_ms": deadline_ms})
    grant = state.admission.decide(state.clock(), ask)
    assert type(grant) is Grant
    request = state.lifecycle.admit(owner, rid, grant, state.clock())
    state.lifecycle.dispatch(request, GenerateRequest(rid, "hi"))
    return request


def balanced(state: ServerState) -> bool:
    return state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


# Each ending, what it renders, how the governor counts it, and how its endpoint does (executed,
# failed): only a `done` and a failure of the endpoint's own count there, never the client's fault.
ENDINGS = [
    ("finish", Completion("hi", 1, 1, FinishReason.LENGTH, 0.0), ("done", FinishReason.LENGTH), "executed", (1, 0)),
    ("fail", BadFrame("too long", "r"), ("error", "bad_frame"), "rejected", (0, 0)),
    ("fail", InternalError("boom", "r"), ("error", "internal"), "failed", (0, 1)),
    ("fail", DeadlineExceeded("late", "r"), ("error", "deadline_exceeded"), "failed", (0, 0)),
    ("busy", 250, ("yield", "endpoint_busy", 250), "yielded", (0, 0)),
    ("lose", "gone", ("error", "worker_lost"), "failed", (0, 1)),
]


@pytest.mark.parametrize(("ending", "argument", "render", "counted", "at_endpoint"), ENDINGS)
def test_each_ending_settles_once_then_renders_once(
    ending: str, argument: Any, render: tuple[Any, ...], counted: str, at_endpoint: tuple[int, int]
) -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    owner = Owner()
    request = admitted(state, owner)
    request.grant.endpoint.up = False  # nowhere to re-route: busy and lose end it here
    getattr(state.lifecycle, ending)(request, argument)
    assert owner.rendered == [render] and owner.phases == [Phase.SETTLED] and not owner.active
    assert request.uid not in upstream.link.inflight  # its link routes nothing more to it
    assert state.admission.inflight.inflight == 0 and balanced(state)
    assert {
        "executed": state.accounting.executed,
        "rejected": state.accounting.rejected_total,
        "failed": state.accounting.failed_total,
        "yielded": state.accounting.yielded_total,
    }[counted] == 1
    endpoint = request.grant.endpoint
    assert endpoint is not None and (endpoint.executed, endpoint.failed) == at_endpoint
    with pytest.raises(LifecycleError):  # a second ending is a bug: nothing freed or rendered twice
        state.lifecycle.fail(request, InternalError("again", "r"))
    assert owner.rendered == [render] and balanced(state)


@pytest.mark.parametrize("ending", ["busy", "lose"])
def test_busy_and_lose_reroute_once_before_the_first_token(ending: str) -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(upstream=upstream, clock=clock, endpoints=two_endpoints(clock))
    owner = Owner()
    request = admitted(state, owner)
    first, first_uid = request.grant.endpoint, request.uid
    assert first is not None
    first.up = False
    getattr(state.lifecycle, ending)(request, 250 if ending == "busy" else "gone")
    assert owner.rendered == [] and request.phase is Phase.DISPATCHED  # the client cannot tell
    assert request.grant.endpoint is not first and state.accounting.rerouted == 1 and len(upstream.dispatched) == 2
    assert first_uid not in upstream.link.inflight and request.uid in upstream.link.inflight
    # A request lost is the lost endpoint's failure, re-routed or not; an endpoint that said it is
    # full (busy) failed nothing
    assert first.failed == (1 if ending == "lose" else 0)
    getattr(state.lifecycle, ending)(request, 250 if ending == "busy" else "gone")  # once only
    assert [r[0] for r in owner.rendered] == ["yield" if ending == "busy" else "error"]
    second = request.grant.endpoint
    assert second is not None and (first.failed, second.failed) == ((1, 1) if ending == "lose" else (0, 0))
    assert state.admission.inflight.inflight == 0 and all(e.inflight == 0 for e in state.admission.pool.endpoints)
    assert balanced(state)


def test_a_started_request_is_lost_not_rerouted() -> None:
    clock = FakeClock()
    state = make_state(upstream=FakeUpstream(), clock=clock, endpoints=two_endpoints(clock))
    owner = Owner()
    request = admitted(state, owner)
    state.lifecycle.token(request)
    assert request.phase is Phase.STARTED and request.tokens_seen == 1
    state.lifecycle.lose(request, "gone")  # tokens were streamed: another endpoint cannot take over
    assert owner.rendered == [("error", "worker_lost")] and state.accounting.rerouted == 0 and balanced(state)


def test_abandon_cancels_and_settles_everything_its_owner_holds_and_renders_nothing() -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    owner, other = Owner(), Owner()
    admitted(state, owner, "a"), admitted(state, other, "b")
    state.lifecycle.abandon(owner, CLIENT_DISCONNECTED)
    assert owner.rendered == [] and not owner.active and list(other.active) == ["b"]
    assert [f["id"] for f in upstream.sent_frames] == ["1"]  # the worker is told to stop it
    assert state.accounting.failed[CLIENT_DISCONNECTED] == 1 and state.admission.inflight.inflight == 1
    assert sum(e.failed for e in state.admission.pool.endpoints) == 0  # a client gone: not the endpoint's failure
    assert balanced(state)


def test_a_missed_deadline_fails_the_request_and_flushes_its_owner() -> None:
    clock = FakeClock()
    timers = FakeTimers(clock)
    upstream = FakeUpstream()
    state = make_state(upstream=upstream, clock=clock, timers=timers)
    owner = Owner()
    admitted(state, owner, deadline_ms=100)
    clock.advance(0.2)
    assert timers.fire_due() == 1
    assert owner.rendered == [("error", "deadline_exceeded")] and owner.flushes == 1  # a timer: no read flushes
    assert upstream.sent_frames == [{"id": "1", "op": "cancel"}] and state.accounting.deadlines["expired"] == 1
    assert balanced(state)
