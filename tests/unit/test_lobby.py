"""The lobby and the promise horizon through the NDJSON door, on a simulated clock: a client that
comes back for its appointment before its capacity frees is held (no reply) and admitted the
moment it frees, or refused for good at its promise horizon; nobody else is ever held; a
held client that leaves gives its place back; a drain answers it; a refusal past the horizon is
final and books nothing; every frame is answered exactly once."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from governor.admission.cost import Ask
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.admission.tenant import TenantLimits
from governor.state import ServerState
from govwire.codec import encode, encode_token, generate_frame
from tests.fakes import FakeClock, FakeTimers, done_frame, make_ingress, make_state, worker_sends

STEP_MS = 10.0  # the endpoint's prior: a token every 10 ms


def frame(rid: str, tokens: int = 4, ticket: str | None = None) -> bytes:
    obj = generate_frame(rid, "p-" + rid, max_new_tokens=tokens, stop_on_eos=False)  # its length known
    if ticket is not None:
        obj["retry_ticket"] = ticket
    return encode(obj)


def setup(max_inflight: int = 1, horizon_ms: float = 1000.0) -> tuple[ServerState, FakeClock, FakeTimers, Any, Any]:
    clock = FakeClock()
    timers = FakeTimers(clock)
    endpoint = Endpoint("fake", EndpointLimits(step_ms=STEP_MS), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=max_inflight,
        clock=clock,
        timers=timers,
        endpoints=[endpoint],
        hint_policy=RetryHintPolicy(jitter=0.0, horizon_ms=horizon_ms),
    )
    ingress, writes = make_ingress(state)
    return state, clock, timers, ingress, writes


def replies(writes: Any) -> list[dict[str, Any]]:
    """The replies written since the last call, but for streamed tokens."""
    out = [reply for reply in map(orjson.loads, writes.lines()) if reply["status"] != "token"]
    writes.chunks.clear()
    return out


def finish(state: ServerState, ingress: Any, rid: str) -> None:
    worker_sends(state, done_frame(ingress.active[rid].uid, "", "length", prompt_tokens=1, completion_tokens=4))


def test_a_client_back_before_its_slot_frees_is_held_and_admitted_the_moment_it_frees() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))  # 4 tokens at 10 ms: forecast to end 40 ms after admission
    ingress.receive_data(frame("b"))
    (refused,) = replies(writes)
    # "Be here by": the forecast release less what holders are late (nothing yet) and a millisecond
    assert (refused["status"], refused["retry_hint_ms"], "final" in refused) == ("yield", 39, False)
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=refused["retry_ticket"]))
    assert replies(writes) == [] and "b" in ingress.in_lobby and len(state.lobby) == 1  # held: no answer yet
    clock.advance(0.006)  # "a" ends 6 ms late
    finish(state, ingress, "a")
    assert replies(writes)[0]["status"] == "done"
    assert timers.fire_due() == 1  # the lobby's wake-up, on the next turn
    assert "b" in ingress.active and not ingress.in_lobby and replies(writes) == []  # admitted, no yield
    assert state.lobby.wait.count == 1 and state.lobby.wait.total == pytest.approx(0.006)
    assert state.admission.appointments.outcomes == {("inflight", "on_time"): 1}
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_the_capacity_is_kept_for_a_held_client_a_newcomer_is_refused_meanwhile() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=ticket))
    finish(state, ingress, "a")
    replies(writes)
    ingress.receive_data(frame("c"))  # in the same turn as the release: the slot is b's
    (told,) = replies(writes)
    assert told["id"] == "c" and told["status"] == "yield"
    timers.fire_due()
    assert "b" in ingress.active and "c" not in ingress.active


def test_a_tenants_own_cap_keeps_its_appointments_through_the_lobby() -> None:
    """tenant_inflight books in the tenant's own book: its holder back early is held, kept from
    a newcomer of the tenant, and admitted the moment one of the tenant's requests ends, while
    another tenant is never kept out by it."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    endpoint = Endpoint("fake", EndpointLimits(step_ms=STEP_MS), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=8,
        clock=clock,
        timers=timers,
        endpoints=[endpoint],
        hint_policy=RetryHintPolicy(jitter=0.0),
        tenants={"a": TenantLimits(max_inflight=1)},
        tenant_from_frame=True,
    )
    ingress, writes = make_ingress(state)

    def tenant_frame(rid: str, tenant: str, ticket: str | None = None) -> bytes:
        obj = generate_frame(rid, "p-" + rid, max_new_tokens=4, tenant=tenant, stop_on_eos=False)
        if ticket is not None:
            obj["retry_ticket"] = ticket
        return encode(obj)

    ingress.receive_data(tenant_frame("a1", "a") + tenant_frame("a2", "a"))
    (refused,) = replies(writes)
    assert (refused["reason"], refused["retry_hint_ms"], "retry_ticket" in refused) == ("tenant_inflight", 39, True)
    clock.advance(0.039)
    ingress.receive_data(tenant_frame("a2", "a", refused["retry_ticket"]))
    assert replies(writes) == [] and "a2" in ingress.in_lobby  # held
    ingress.receive_data(tenant_frame("b1", "b"))
    assert "b1" in ingress.active  # another tenant: nothing of its own cap is kept from it
    clock.advance(0.002)
    finish(state, ingress, "a1")
    ingress.receive_data(tenant_frame("a3", "a"))  # a newcomer of a's: the slot is kept for a2
    assert [(r["status"], r.get("reason")) for r in replies(writes)] == [("done", None), ("yield", "tenant_inflight")]
    assert timers.fire_due() == 1
    assert "a2" in ingress.active and not ingress.in_lobby
    assert state.admission.appointments.outcomes[("tenant_inflight", "on_time")] == 1


def test_a_holder_is_held_past_its_window_until_its_capacity_frees() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=ticket))
    clock.advance(0.3)  # its 50 ms window closed long ago; "a" runs 300 ms late: b is still held
    assert timers.fire_due() == 0 and "b" in ingress.in_lobby
    finish(state, ingress, "a")
    timers.fire_due()
    assert "b" in ingress.active and replies(writes)[0]["status"] == "done"  # a's done; b admitted, no yield
    appointments = state.admission.appointments
    assert appointments.outcomes == {("inflight", "on_time"): 1}
    assert appointments.lateness_s == pytest.approx(0.0)  # it came on time: its own lateness is 0
    assert appointments.release_lateness_s == pytest.approx(0.1 * 0.3)  # the release was 300 ms late


def test_a_holder_not_admitted_by_its_promise_horizon_is_told_no_for_good() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=ticket))
    clock.advance(1.0 - 0.039 - 0.001)  # the last call: the horizon (1 s) from its first refusal
    assert timers.fire_due() == 1
    (told,) = replies(writes)
    assert told["final"] is True and "retry_ticket" not in told and not ingress.in_lobby
    assert state.admission.appointments.outcomes == {("inflight", "yielded_again"): 1}
    assert not state.admission.inflight.book.entries and state.lobby.wait.count == 1


def test_no_client_waits_on_promises_past_the_horizon_from_its_first_refusal() -> None:
    state, clock, timers, ingress, writes = setup(horizon_ms=60.0)
    ingress.receive_data(frame("a", tokens=5))  # forecast to end in 50 ms
    ingress.receive_data(frame("b"))
    told = replies(writes)[0]
    assert told["retry_hint_ms"] == 49 and "final" not in told
    clock.advance(0.049)
    ingress.receive_data(frame("b", ticket=told["retry_ticket"]))
    clock.advance(0.025)  # "a" overruns: at its window's close (past the 60 ms horizon) b is told no
    timers.fire_due()
    (again,) = replies(writes)
    assert again["final"] is True and "retry_ticket" not in again and not ingress.in_lobby
    assert not state.admission.inflight.book.entries


def test_only_returning_clients_are_held_a_first_arrival_or_a_forged_ticket_is_answered_at_once() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    replies(writes)
    clock.advance(0.039)  # inside b's window, its slot not free
    ingress.receive_data(frame("c") + frame("d", ticket="0" * 24) + frame("e", ticket="forged"))
    assert [r["status"] for r in replies(writes)] == ["yield"] * 3 and not ingress.in_lobby


def test_a_second_frame_for_a_held_appointment_is_a_new_client() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=ticket))
    ingress.receive_data(frame("b2", ticket=ticket))  # the same ticket again: no second place in the lobby
    (told,) = replies(writes)
    assert told["id"] == "b2" and told["status"] == "yield" and len(state.lobby) == 1
    ingress.receive_data(frame("b"))  # its id while it is held: a duplicate, as for one in flight
    assert replies(writes)[0]["code"] == "duplicate_id"


def test_a_held_client_that_leaves_gives_its_place_back_and_is_counted() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    other, other_writes = make_ingress(state)
    other.receive_data(frame("b", ticket=ticket))
    assert len(state.lobby) == 1
    other.connection_lost()
    assert len(state.lobby) == 0 and not state.admission.inflight.book.entries  # its appointment went back
    assert state.accounting.failed["client_disconnected"] == 1
    finish(state, ingress, "a")
    replies(writes)
    ingress.receive_data(frame("c"))  # the slot is anyone's at once
    assert "c" in ingress.active
    assert timers.fire_due() >= 0 and other_writes.lines() == []
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_a_cancel_for_a_held_frame_answers_it_cancelled_and_gives_its_place_back() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a") + frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=ticket))
    assert "b" in ingress.in_lobby and replies(writes) == []
    ingress.receive_data(encode({"op": "cancel", "id": "b"}))
    (reply,) = replies(writes)
    assert (reply["id"], reply["status"], reply["finish_reason"], reply["completion_tokens"]) == (
        "b",
        "done",
        "cancelled",
        0,
    )
    assert not ingress.in_lobby and len(state.lobby) == 0 and not state.admission.inflight.book.entries
    assert state.accounting.failed["client_cancelled"] == 1
    ingress.receive_data(encode({"op": "cancel", "id": "b"}))  # again: nothing held, nothing said
    finish(state, ingress, "a")
    assert timers.fire_due() >= 0 and [r["id"] for r in replies(writes)] == ["a"]  # b is never answered twice
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_a_holder_waiting_on_a_paused_endpoint_is_let_in_when_its_pause_ends() -> None:
    """Two endpoints at their caps; one answers 429 (paused 50 ms, its request yielded): a holder
    back in its window finds the other still full and the paused one closed, and is held; when
    the pause ends the lobby is told, and the holder gets the paused endpoint's slot."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    endpoints = [Endpoint(name, EndpointLimits(concurrency=1, step_ms=STEP_MS), clock()) for name in ("e1", "e2")]
    for endpoint in endpoints:
        endpoint.up = True
    state = make_state(
        max_inflight=8, clock=clock, timers=timers, endpoints=endpoints, hint_policy=RetryHintPolicy(jitter=0.0)
    )
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a") + frame("b") + frame("c"))
    (refused,) = replies(writes)
    assert (refused["id"], refused["reason"]) == ("c", "endpoint_inflight")
    clock.advance(0.02)
    b = ingress.active["b"]
    paused = b.grant.endpoint
    assert paused is not None
    paused.paused_until = clock() + 0.05  # (what its link does on a 429 with Retry-After 50 ms)
    state.lifecycle.busy(b, 50)
    ingress.flush()
    assert [r["reason"] for r in replies(writes)] == ["endpoint_busy"]
    clock.advance(0.019)
    ingress.receive_data(frame("c", ticket=refused["retry_ticket"]))
    timers.fire_due()
    assert "c" in ingress.in_lobby  # the free slot is paused, the other one taken
    clock.advance(0.031)
    timers.fire_due()  # the pause's end wakes the lobby
    timers.fire_due()
    assert "c" in ingress.active and ingress.active["c"].grant.endpoint is paused


def test_a_drain_answers_every_held_frame() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b"))
    ticket = replies(writes)[0]["retry_ticket"]
    clock.advance(0.039)
    ingress.receive_data(frame("b", ticket=ticket))
    state.admission.start_draining()
    state.lobby.answer_all()
    (told,) = replies(writes)
    assert (told["id"], told["reason"], "final" in told) == ("b", "draining", False)
    assert not ingress.in_lobby and len(state.lobby) == 0


def test_past_the_horizon_a_refusal_is_final_and_books_nothing() -> None:
    state, clock, timers, ingress, writes = setup(horizon_ms=30.0)
    ingress.receive_data(frame("a"))  # ends in 40 ms: past a 30 ms horizon
    ingress.receive_data(frame("b"))
    (told,) = replies(writes)
    assert told["final"] is True and "retry_ticket" not in told and told["retry_hint_ms"] >= 30
    assert not state.admission.inflight.book.entries
    assert state.accounting.final["inflight"] == 1 and state.accounting.yielded["inflight"] == 1


@pytest.mark.parametrize("short_streamed", [True, False], ids=["short-started", "short-not-started"])
def test_a_short_request_near_its_end_is_what_a_refused_critical_frame_is_told(short_streamed: bool) -> None:
    """The review's critical scenario: --max-inflight 10, a token every 50 ms, nine 40-token
    requests running and a 4-token one admitted 50 ms earlier (with its first token or not yet):
    the refused frame is told the short one's end (~150-200 ms), never the long ones' (~2 s), and
    coming back then it is let in (held if the short one runs a little late)."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    endpoint = Endpoint("fake", EndpointLimits(step_ms=50.0), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=10, clock=clock, timers=timers, endpoints=[endpoint], hint_policy=RetryHintPolicy(jitter=0.0)
    )
    ingress, writes = make_ingress(state)
    for i in range(9):
        ingress.receive_data(frame(f"long{i}", tokens=40))
    ingress.receive_data(frame("short", tokens=4))
    for rid in (("short",) if short_streamed else ()) + tuple(f"long{i}" for i in range(9)):
        worker_sends(state, encode_token(ingress.active[rid].uid, 0, 1, "x"))
    clock.advance(0.05)
    ingress.receive_data(
        encode({**generate_frame("crit", "p", max_new_tokens=4, stop_on_eos=False), "priority": "critical"})
    )
    (told,) = replies(writes)
    # started: 3 tokens left at 50 ms from its first (at 0); not started: a first token and 3 more
    assert told["status"] == "yield" and 90 <= told["retry_hint_ms"] <= 160 + 50 * (not short_streamed)
    clock.advance(told["retry_hint_ms"] / 1000)
    ingress.receive_data(
        encode(
            {
                **generate_frame("crit", "p", max_new_tokens=4, stop_on_eos=False),
                "priority": "critical",
                "retry_ticket": told["retry_ticket"],
            }
        )
    )
    assert "crit" in ingress.in_lobby  # the short one has not ended yet: held, not refused
    clock.advance(0.01)
    finish(state, ingress, "short")
    timers.fire_due()
    assert "crit" in ingress.active


class LobbyMachine(RuleBasedStateMachine):
    """Any interleaving of arrivals, returns (on time or not, with or without the ticket), ends,
    disconnects and timers: the cap is never exceeded, held frames never outnumber the open
    appointments, every frame sent is answered exactly once (or counted failed with its
    connection), and the counters balance."""

    def __init__(self) -> None:
        super().__init__()
        self.state, self.clock, self.timers, self.ingress, self.writes = setup(max_inflight=2, horizon_ms=200.0)
        self.sent = 0
        self.answered = 0
        self.lost = 0
        self.tickets: dict[str, str] = {}
        self.next = 0

    def _collect(self) -> None:
        for reply in replies(self.writes):
            if reply["status"] in ("yield", "error") or reply["status"] == "done":
                self.answered += 1
            if reply["status"] == "yield" and "retry_ticket" in reply:
                self.tickets[reply["id"]] = reply["retry_ticket"]

    @rule()
    def arrive(self) -> None:
        self.next += 1
        self.sent += 1
        rid = f"r{self.next}"
        admission = self.state.admission
        book = admission.inflight.book
        assert book is not None
        kept = sum(1 for e in book.entries if e.opened(self.clock()))
        taken = admission.inflight.inflight + kept  # before it came: in flight, and kept for holders
        self.ingress.receive_data(frame(rid))
        if rid not in self.ingress.active and not self.ingress.held_frames:
            assert taken >= admission.inflight.max_inflight  # refused only when no slot was idle for it
        self._collect()

    @rule(data=st.data(), with_ticket=st.booleans())
    def come_back(self, data: st.DataObject, with_ticket: bool) -> None:
        if not self.tickets:
            return
        rid = data.draw(st.sampled_from(sorted(self.tickets)))
        if rid in self.ingress.active or rid in self.ingress.in_lobby:
            return
        ticket = self.tickets.pop(rid)
        self.sent += 1
        self.ingress.receive_data(frame(rid, ticket=ticket if with_ticket else None))
        self._collect()

    @rule(ms=st.integers(0, 60))
    def wait(self, ms: int) -> None:
        self.clock.advance(ms / 1000)
        self.timers.fire_due()
        self.ingress.resume(16)  # the connection's next turn answers frames deferred after refusals
        self._collect()

    @rule(data=st.data())
    def end_one(self, data: st.DataObject) -> None:
        if not self.ingress.active:
            return
        rid = data.draw(st.sampled_from(sorted(self.ingress.active)))
        finish(self.state, self.ingress, rid)
        self.timers.fire_due()
        self._collect()

    @rule()
    def reconnect(self) -> None:
        self.lost += len(self.ingress.active) + len(self.ingress.in_lobby) + self.ingress.held_frames
        self.ingress.connection_lost()
        self.ingress, self.writes = make_ingress(self.state)
        self.tickets.clear()

    @invariant()
    def caps_and_lobby_are_bounded(self) -> None:
        admission = self.state.admission
        assert admission.inflight.inflight <= admission.inflight.max_inflight
        book = admission.inflight.book
        assert book is not None
        open_now = sum(1 for e in book.entries if e.opened(self.clock()))
        assert len(self.state.lobby) <= open_now
        assert len(self.state.lobby) == len(self.ingress.in_lobby)
        horizon_s = admission.horizon_ms / 1000
        assert all(e.at - e.booked_at < horizon_s for e in book.entries)  # every promise inside the horizon

    @invariant()
    def every_frame_is_answered_once(self) -> None:
        pending = len(self.ingress.active) + len(self.ingress.in_lobby) + self.ingress.held_frames
        assert self.answered + self.lost + pending == self.sent
        assert self.state.accounting.unbalanced_by(self.state.admission.inflight.inflight) == 0


LobbyMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestLobbyMachine = LobbyMachine.TestCase


def test_a_flood_of_100k_clients_books_only_the_horizon_and_holds_only_the_open_appointments() -> None:
    """100,000 frames at a full cap, then each sent again at once (with its ticket when it got
    one, a forged one else): appointments only reach the horizon, the rest are final; the returns
    held are at most the appointments whose window is open; what the governor keeps stays bounded."""
    state, clock, timers, ingress, writes = setup(max_inflight=4)
    for rid in ("a", "b", "c", "d"):
        ingress.receive_data(frame(rid))  # 4 tokens at 10 ms each: a release every 40 ms per slot
    flood = 100_000
    tickets: dict[str, str] = {}
    finals = 0
    for i in range(0, flood, 500):
        ingress.receive_data(b"".join(frame(f"f{j}") for j in range(i, i + 500)))
        ingress.resume(10**6)
        for reply in replies(writes):
            if reply.get("final"):
                finals += 1
            elif "retry_ticket" in reply:
                tickets[reply["id"]] = reply["retry_ticket"]
    booked = len(state.admission.inflight.book.entries)
    assert booked == len(tickets) and booked <= 4 * (1000 // 40) and finals == flood - booked
    clock.advance(0.5)  # half the horizon on: some windows open, most not
    for i in range(0, flood, 500):
        ingress.receive_data(b"".join(frame(f"f{j}", ticket=tickets.get(f"f{j}", "forged")) for j in range(i, i + 500)))
        ingress.resume(10**6)
        replies(writes)
    book = state.admission.inflight.book
    open_now = sum(1 for e in book.entries if e.opened(clock()))
    assert len(state.lobby) <= open_now <= booked
    registry = state.admission.appointments  # what it keeps is bounded by the appointments, not the 200k frames
    assert len(registry.by_ticket) <= booked and len(registry.by_identity) <= booked
    assert len(registry.lapsed) <= 2 * booked


def test_a_held_holder_does_not_keep_the_no_shows_after_it_from_lapsing() -> None:
    state, clock, timers, ingress, writes = setup()
    ingress.receive_data(frame("a"))
    ingress.receive_data(frame("b") + frame("c"))  # b told a's end, c the round after
    told = {r["id"]: r for r in replies(writes)}
    clock.advance(told["b"]["retry_hint_ms"] / 1000)
    ingress.receive_data(frame("b", ticket=told["b"]["retry_ticket"]))  # held: a runs late
    clock.advance(told["c"]["retry_hint_ms"] / 1000 + 0.1)  # c never comes; its window closed
    ingress.receive_data(frame("d"))  # any refusal sweeps the book
    tickets = [e.ticket for e in state.admission.inflight.book.entries]
    assert told["b"]["retry_ticket"] in tickets and told["c"]["retry_ticket"] not in tickets  # c lapsed, b kept


def test_clients_sending_the_same_body_are_each_recognised_while_one_is_held() -> None:
    """HTTP clients re-sending one body (a load generator's fixed prompt) are told apart by their
    appointments' windows: one held in the lobby does not make the next one a new client."""
    clock = FakeClock()
    endpoint = Endpoint("fake", EndpointLimits(step_ms=STEP_MS), clock())
    endpoint.up = True
    state = make_state(max_inflight=1, clock=clock, endpoints=[endpoint], hint_policy=RetryHintPolicy(jitter=0.0))
    admission = state.admission
    assert isinstance(admission.decide(clock(), Ask(max_new_tokens=4)), Grant)

    def same_body() -> Ask:
        ask = Ask(max_new_tokens=4)
        ask.identity = 42  # the same body, not unique to a client
        return ask

    first = admission.decide(clock(), same_body())
    assert isinstance(first, Refusal)
    one = first.appointment  # (read at once: the limit's refusal object is reused)
    second = admission.decide(clock(), same_body())
    assert isinstance(second, Refusal)
    two = second.appointment
    assert one is not None and two is not None and one is not two
    one.hold(clock())  # the first client is back and held
    clock.advance(two.at - clock())
    back = same_body()
    admission.decide(clock(), back)
    assert back.appointment is two  # the second client's own appointment, not a new client
