"""Displacement before the first token, through the NDJSON door on a simulated clock: a critical
frame at the full cap takes the slot of the newest not-started request of the lowest class, whose
client gets a `preempted` yield with a hint and an appointment; never a started request, never an
equal class, never twice, at most one per release gap."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.admission.cost import Ask
from governor.admission.displacement import Displacement
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintPolicy
from governor.admission.limits import Grant
from governor.lifecycle import InflightRequest
from governor.state import ServerState
from govwire.codec import encode, encode_token, generate_frame
from govwire.vocab import Op, Priority, YieldReason
from tests.fakes import FakeClock, FakeTimers, FakeUpstream, done_frame, make_ingress, make_state, worker_sends

PREEMPTED = YieldReason.PREEMPTED.value


def frame(rid: str, prompt: str = "hi", **fields: Any) -> bytes:
    return encode(generate_frame(rid, prompt, **fields))


def replies(writes: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in writes.lines()]


def start(state: ServerState, request: InflightRequest) -> None:
    """Its first token arrives from the worker."""
    worker_sends(state, encode_token(request.uid, 0, 1, "x"))


def finish(state: ServerState, request: InflightRequest) -> None:
    worker_sends(state, done_frame(request.uid, "", "eos", prompt_tokens=1, completion_tokens=1))


def setup(
    max_inflight: int = 4, preempt: bool = True, step_ms: float = 50.0, service_s: float = 1.0
) -> tuple[ServerState, FakeClock, FakeTimers, Any, Any]:
    clock = FakeClock()
    timers = FakeTimers(clock)
    hints = RetryHintPolicy(jitter=0.0)  # exact hints: comparable across clients
    # A request (16 tokens, the default max_new_tokens) is forecast to end 16 x 50 ms = 0.8 s after
    # its admission (no stream seen: `step_ms` is the prior): inside the promise horizon (1 s), so
    # its refused clients are booked.
    endpoint = Endpoint("fake", EndpointLimits(step_ms=step_ms), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=max_inflight,
        clock=clock,
        timers=timers,
        preempt=preempt,
        hint_policy=hints,
        endpoints=[endpoint],
    )
    state.admission.hints.observe_service_time(service_s)  # a release gap of 1 s / the cap
    ingress, writes = make_ingress(state)
    return state, clock, timers, ingress, writes


def test_a_critical_frame_at_the_full_cap_takes_the_newest_sheddable_slot_not_started() -> None:
    state, clock, timers, ingress, writes = setup()
    upstream = state.upstream
    assert isinstance(upstream, FakeUpstream)
    ingress.receive_data(frame("s0", priority="sheddable") + frame("s1", priority="sheddable"))
    ingress.receive_data(frame("t0", priority="standard") + frame("t1", priority="standard"))
    victim = ingress.active["s1"]
    ingress.receive_data(frame("c0", priority="critical"))
    # Admitted in the same turn; the governor's in-flight count never went past the cap.
    assert "c0" in ingress.active and "s1" not in ingress.active
    assert state.admission.inflight.inflight == 4
    assert upstream.sent_frames == [{"id": victim.uid, "op": Op.CANCEL}]  # stopped in its worker
    assert not replies(writes)  # the victim's answer comes on the next turn of the loop
    timers.fire_due()
    (answer,) = replies(writes)
    assert answer["id"] == "s1" and answer["status"] == "yield" and answer["reason"] == PREEMPTED
    assert answer["retry_hint_ms"] >= 1 and isinstance(answer["retry_ticket"], str)
    s = state.snapshot()
    assert s["yielded_by_reason"][PREEMPTED] == 1 and s["inflight"] == 4
    assert s["classes"]["sheddable"]["preempted_total"] == 1 and s["classes"]["standard"]["preempted_total"] == 0
    assert state.admission.displacement.total == {("sheddable", "default"): 1}
    received = s["received_total"]
    settled = s["executed_total"] + s["yielded_total"] + s["rejected_total"] + s["failed_total"]
    assert received == settled + s["inflight"]  # the victim counts once: yielded
    # A worker's late final reply for the victim is dropped (it was settled already).
    finish(state, victim)
    assert state.admission.inflight.inflight == 4 and len(replies(writes)) == 1


def test_at_most_one_per_release_gap_lowest_class_first_and_never_a_started_or_equal_class() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("s0", priority="sheddable") + frame("t0", priority="standard"))
    ingress.receive_data(frame("t1", priority="standard") + frame("c0", priority="critical"))
    start(state, ingress.active["s0"])  # streamed a token: never displaced
    ingress.receive_data(frame("c1", priority="critical"))
    assert "c1" in ingress.active and "t1" not in ingress.active  # the newest standard: s0 had started
    ingress.receive_data(frame("c2", priority="critical"))
    assert "c2" not in ingress.active  # within a release gap (1 s / 4) of the last displacement
    clock.advance(0.3)
    ingress.receive_data(frame("t2", priority="standard"))  # the full cap, and no class below it to displace
    assert "t2" not in ingress.active and "t0" in ingress.active
    ingress.receive_data(frame("c3", priority="critical"))
    assert "c3" in ingress.active and "t0" not in ingress.active
    clock.advance(0.3)
    ingress.receive_data(frame("c4", priority="critical"))  # only s0 (started) and critical ones left
    assert "c4" not in ingress.active
    timers.fire_due()
    reasons = {r["id"]: r["reason"] for r in replies(writes) if r["status"] == "yield"}
    assert reasons == {"t1": PREEMPTED, "c2": "inflight", "t2": "inflight", "t0": PREEMPTED, "c4": "inflight"}
    assert state.admission.inflight.inflight == 4


def test_a_victim_coming_back_with_its_ticket_is_let_in_and_never_displaced_again() -> None:
    state, clock, timers, ingress, writes = setup(max_inflight=2)
    ingress.receive_data(frame("s0", "one", priority="sheddable") + frame("s1", "two", priority="sheddable"))
    ingress.receive_data(frame("c0", priority="critical"))
    timers.fire_due()
    (answer,) = replies(writes)
    assert answer["id"] == "s1" and answer["reason"] == PREEMPTED
    clock.advance(answer["retry_hint_ms"] / 1000)
    finish(state, ingress.active["s0"])  # a slot frees in s1's window: kept for it
    ingress.receive_data(frame("other", priority="sheddable"))
    assert "other" not in ingress.active
    ingress.receive_data(frame("s1", "two", priority="sheddable", retry_ticket=answer["retry_ticket"]))
    assert "s1" in ingress.active
    assert state.snapshot()["retry_hints"]["outcomes"]["inflight"]["on_time"] == 1
    clock.advance(1.0)
    finish(state, ingress.active["c0"])
    ingress.receive_data(frame("s2", priority="sheddable"))  # the cap is full again: s1 and s2
    ingress.receive_data(frame("c1", priority="critical"))
    assert "c1" in ingress.active and "s2" not in ingress.active and "s1" in ingress.active


def test_preempt_off_refuses_as_before() -> None:
    state, clock, timers, ingress, writes = setup(max_inflight=1, preempt=False)
    ingress.receive_data(frame("s0", priority="sheddable") + frame("c0", priority="critical"))
    assert list(ingress.active) == ["s0"]
    assert [r["reason"] for r in replies(writes)] == ["inflight"]
    assert state.admission.displacement.total == {}


def test_a_governor_whose_clients_send_no_class_follows_no_candidates() -> None:
    state, clock, timers, ingress, writes = setup(max_inflight=2)
    ingress.receive_data(frame("a") + frame("b") + frame("c"))
    assert len(state.admission.displacement) == 0 and not state.admission.ceilings.classes_seen
    ingress.receive_data(frame("s", priority="sheddable"))  # refused, but from now on classes count
    assert state.admission.ceilings.classes_seen


def test_victim_order_is_lowest_class_then_newest() -> None:
    displacement = Displacement()
    grants = {}
    for name, priority in (("s0", Priority.SHEDDABLE), ("t0", Priority.STANDARD), ("s1", Priority.SHEDDABLE)):
        grants[name] = Grant(Ask(priority=priority))
        displacement.charge(grants[name], 0.0)
    critical, standard = Ask(priority=Priority.CRITICAL), Ask(priority=Priority.STANDARD)
    assert displacement.victim(0.0, critical) is grants["s1"]
    displacement.displaced(grants["s1"], 0.0, 0.5, Priority.CRITICAL)
    assert displacement.victim(0.4, critical) is None  # a release gap has not passed
    assert displacement.victim(0.4, standard) is grants["s0"]  # (a gap for each displacing class)
    displacement.started(grants["s0"])
    assert displacement.victim(0.5, standard) is None  # standard never displaces standard
    assert displacement.victim(0.5, critical) is grants["t0"]
    assert displacement.victim(0.5, Ask(priority=Priority.SHEDDABLE)) is None


class DisplacementMachine(RuleBasedStateMachine):
    """Frames of the three classes, first tokens, completions, disconnects and time, over a cap of
    4 with displacement on: the cap holds at every step, a displaced request had not started, was
    of a strictly lower class than the frame that took its slot, is answered exactly once (after
    the timers fire), and every frame is accounted for."""

    CAP = 4

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.timers = FakeTimers(self.clock)
        self.state = make_state(max_inflight=self.CAP, clock=self.clock, timers=self.timers)
        self.state.admission.hints.observe_service_time(0.4)
        self.conns = [make_ingress(self.state) for _ in range(2)]
        self.started: set[str] = set()
        self.n = 0

    def live(self) -> list[InflightRequest]:
        return [r for ingress, _ in self.conns for r in ingress.active.values()]

    @rule(conn=st.integers(0, 1), priority=st.sampled_from(["critical", "standard", "sheddable"]))
    def send(self, conn: int, priority: str) -> None:
        self.n += 1
        rid = f"r{self.n}"
        before = {r.client_id: r for r in self.live()}
        ingress, _ = self.conns[conn]
        ingress.receive_data(frame(rid, priority=priority))
        gone = [r for cid, r in before.items() if r.client_id not in {x.client_id for x in self.live()}]
        if gone:  # displaced by this frame (nothing else ends a request within a receive)
            (victim,) = gone
            assert rid in ingress.active
            assert victim.t_first_token is None and victim.client_id not in self.started
            order = {"sheddable": 0, "standard": 1, "critical": 2}
            assert order[victim.grant.ask.priority.value] < order[priority]

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def first_token(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.live()))
        if request.t_first_token is None:
            start(self.state, request)
            self.started.add(request.client_id)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def worker_finishes_one(self, data: st.DataObject) -> None:
        finish(self.state, data.draw(st.sampled_from(self.live())))

    @rule(conn=st.integers(0, 1))
    def disconnect(self, conn: int) -> None:
        self.conns[conn][0].connection_lost()
        self.conns[conn] = make_ingress(self.state)

    @rule(seconds=st.sampled_from([0.01, 0.05, 0.2, 1.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.timers.fire_due()

    @invariant()
    def the_cap_holds_and_every_frame_is_accounted_for(self) -> None:
        s = self.state.snapshot()
        assert s["inflight"] == len(self.live()) <= self.CAP
        settled = s["executed_total"] + s["yielded_total"] + s["rejected_total"] + s["failed_total"]
        assert s["received_total"] == settled + s["inflight"]
        displacement = self.state.admission.displacement
        assert len(displacement) <= len(self.live())
        assert sum(displacement.total.values()) == s["yielded_by_reason"].get(PREEMPTED, 0)

    @invariant()
    def each_request_is_answered_once(self) -> None:
        for _, writes in self.conns:
            ids = [r["id"] for r in replies(writes) if r.get("status") in ("yield", "done", "error")]
            assert len(ids) == len(set(ids)), ids


DisplacementMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestDisplacementMachine = DisplacementMachine.TestCase


def test_an_appointment_holds_against_its_class_and_below_and_a_higher_class_books_ahead() -> None:
    # Requests of 16 x 25 ms = 0.4 s, and a service time of 0.4 s: s1's appointment (at 0.4 s) and
    # the release after it (0.8 s) are inside the promise horizon (a longer service time: below).
    state, clock, timers, ingress, writes = setup(max_inflight=1, preempt=False, step_ms=25.0, service_s=0.4)
    ingress.receive_data(frame("s0", priority="sheddable") + frame("s1", priority="sheddable"))
    ingress.receive_data(frame("c0", priority="critical"))
    hints = {r["id"]: r["retry_hint_ms"] for r in replies(writes)}
    assert hints["c0"] <= hints["s1"]  # booked ahead of the sheddable one's appointment
    clock.advance(hints["s1"] / 1000)
    finish(state, ingress.active["s0"])  # the slot frees in both windows
    ingress.receive_data(frame("t0", priority="standard"))
    assert "t0" not in ingress.active  # held for the appointments: the critical one ranks above it
    ingress.receive_data(frame("c1", priority="critical"))
    assert "c1" not in ingress.active  # held for c0's appointment (its own class)
    ingress.receive_data(frame("c0", priority="critical"))
    assert "c0" in ingress.active  # c0 came back: let in ahead of s1, whose slot comes next


def test_a_higher_class_books_ahead_even_when_the_last_appointment_and_a_gap_reach_past_the_horizon() -> None:
    # Requests of 0.8 s and a service time of 1 s at a cap of 1 (a release gap of 1 s): s1 is
    # booked for s0's release (799 ms, told a millisecond early with the lobby); c0, a class
    # above, goes before s1's appointment in the book: its turn is the same release, inside the
    # 1 s horizon (with horizon_ms=3000 it is told 799 and booked).
    state, clock, timers, ingress, writes = setup(max_inflight=1, preempt=False)
    ingress.receive_data(frame("s0", priority="sheddable", stop_on_eos=False) + frame("s1", priority="sheddable"))
    ingress.receive_data(frame("c0", priority="critical"))
    told = {r["id"]: r for r in replies(writes)}
    assert told["s1"]["retry_hint_ms"] == 799 and told["s1"]["retry_ticket"]
    assert told["c0"]["retry_hint_ms"] <= told["s1"]["retry_hint_ms"] and told["c0"].get("retry_ticket")
    assert not told["c0"].get("final")


def test_a_slot_kept_for_a_sheddable_appointment_does_not_keep_a_critical_frame_out() -> None:
    state, clock, timers, ingress, writes = setup(max_inflight=1, preempt=False)
    ingress.receive_data(frame("s0", priority="sheddable") + frame("s1", priority="sheddable"))
    (refused,) = replies(writes)
    clock.advance(refused["retry_hint_ms"] / 1000)
    finish(state, ingress.active["s0"])
    ingress.receive_data(frame("s2", priority="sheddable"))
    assert "s2" not in ingress.active  # kept for s1 against its own class
    ingress.receive_data(frame("c0", priority="critical"))
    assert "c0" in ingress.active  # but not against a higher one
