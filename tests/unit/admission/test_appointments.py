"""Appointments: the retry hint as a binding promise (admission/appointments/), through the real
`Admission` in front of a simulated engine with known step times, on a simulated clock."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from governor.admission.appointments.appointment import Appointment
from governor.admission.appointments.books import MIN_TRUST, PROBE_EVERY, AppointmentBook
from governor.admission.appointments.registry import LAPSED_MEMORY_S, LATE_KEPT_S, TRUST_WEIGHT, Appointments
from governor.admission.caps import Caps
from governor.admission.cost import Ask
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.admission.priority import RANK, STANDARD_RANK, CeilingPolicy
from governor.admission.tenant import Tenant, TenantLimits
from govwire.vocab import Priority

GRACE_S = 0.05


@dataclass
class Stream:
    tokens_seen: int = 0
    t_first_token: float | None = None
    t_last_token: float = 0.0


@dataclass
class Engine:
    """Each admitted request: its first token `first_s` after admission, then one every `step_s`,
    `tokens` in all, and it ends with its last. Exact, so the forecast can be exact."""

    admission: Admission
    first_s: float
    step_s: float
    tokens: int
    events: list[tuple[float, int, str, Grant, Stream]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def start(self, grant: Grant, now: float) -> None:
        stream = Stream()
        grant.progress = stream
        for i in range(self.tokens):
            at = now + self.first_s + i * self.step_s
            heapq.heappush(self.events, (at, next(self._order), "token", grant, stream))
        end = now + self.first_s + (self.tokens - 1) * self.step_s
        heapq.heappush(self.events, (end, next(self._order), "end", grant, stream))

    def run_until(self, t: float) -> None:
        while self.events and self.events[0][0] <= t + 1e-9:
            at, _, kind, grant, stream = heapq.heappop(self.events)
            if kind == "token":
                stream.tokens_seen += 1
                stream.t_last_token = at
                if stream.t_first_token is None:
                    stream.t_first_token = at
                    self.admission.started(grant, at - grant.t_admitted, at)
            else:
                self.admission.release(grant, True, at)


def governor(cap: int, first_s: float, step_s: float, tokens: int) -> tuple[Admission, Engine, Endpoint]:
    endpoint = Endpoint("e", EndpointLimits(), now=0.0)
    endpoint.up = True
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0), cap)
    admission = Admission([endpoint], Caps(max_inflight=cap), hints, now=0.0, appointment_grace_s=GRACE_S)
    # What earlier requests taught: the engine's exact speed.
    model = admission.forecast.model(endpoint)
    model.first_token_s, model.step_s = first_s, step_s
    hints.observe_service_time(first_s + (tokens - 1) * step_s)
    return admission, Engine(admission, first_s, step_s, tokens), endpoint


def one_running() -> tuple[Admission, Engine]:
    """One slot, taken at 0 by a request streaming 11 tokens: first at 0.1 s, then every 20 ms,
    so it ends at 0.3 s exactly."""
    admission, engine, _ = governor(cap=1, first_s=0.1, step_s=0.02, tokens=11)
    grant = admission.decide(0.0, ask(11, 1))
    assert isinstance(grant, Grant)
    engine.start(grant, 0.0)
    return admission, engine


def ask(
    tokens: int, identity: int, ticket: str | None = None, tenant: Tenant | None = None, unique: bool = False
) -> Ask:
    a = Ask(max_new_tokens=tokens, cost=tokens)
    a.identity, a.ticket, a.tenant, a.identity_unique = identity, ticket, tenant, unique
    return a


def test_the_hint_is_the_slots_release_and_the_slot_is_kept_for_its_holder() -> None:
    admission, engine, _ = governor(cap=1, first_s=0.1, step_s=0.02, tokens=11)  # 0.3 s each
    holder = admission.decide(0.0, ask(11, 1))
    assert isinstance(holder, Grant)
    engine.start(holder, 0.0)
    engine.run_until(0.05)
    refused = admission.decide(0.05, ask(11, 2))
    assert isinstance(refused, Refusal) and refused.reason == "inflight"
    assert refused.hint_ms == 250 and refused.appointment is not None
    ticket = refused.appointment.ticket
    engine.run_until(0.3)  # the slot frees exactly when forecast
    # a fresh frame in the window is refused: the slot is kept; it is told the next one, a service
    # time later (and the hint's resolution: a holder starts up to 1 ms after its release)
    fresh = admission.decide(0.3, ask(11, 3))
    assert isinstance(fresh, Refusal) and fresh.hint_ms == 301
    # the holder comes back, with its ticket and a different body: admitted
    back = admission.decide(0.301, ask(11, 99, ticket=ticket))
    assert isinstance(back, Grant)
    assert admission.appointments.outcomes == {("inflight", "on_time"): 1}


def test_a_cold_forecast_hints_early_and_promises_only_what_its_conservative_side_keeps() -> None:
    """No request that may end early has ended: the hint is read from the optimistic length (a
    quarter of 40: 0.1 s to the first token, 9 steps of 20 ms), whether it is a promise from all
    40 (0.1 s + 39 steps: 0.88 s, inside the 1 s horizon: booked, due then); the next one, a
    service time later, would be due past the horizon: refused for good at once."""
    admission, _, _ = governor(cap=1, first_s=0.1, step_s=0.02, tokens=11)

    def may_end(identity: int) -> Ask:
        a = ask(40, identity)
        a.to_length = False
        return a

    assert isinstance(admission.decide(0.0, may_end(1)), Grant)
    told = admission.decide(0.0, may_end(2))
    assert isinstance(told, Refusal) and told.hint_ms == 280 and told.appointment is not None
    assert told.appointment.due == pytest.approx(0.88)
    final = admission.decide(0.0, may_end(3))
    assert isinstance(final, Refusal) and final.appointment is None and final.hint_ms >= 1000


def test_an_early_holder_is_told_the_time_left_and_keeps_its_appointment() -> None:
    admission, engine = one_running()
    refused = admission.decide(0.0, ask(11, 2))
    assert isinstance(refused, Refusal) and refused.hint_ms == 300
    appointment = refused.appointment
    assert appointment is not None
    again = admission.decide(0.1, ask(11, 2, ticket=appointment.ticket))
    assert isinstance(again, Refusal) and again.hint_ms == 200 and again.appointment is appointment
    assert admission.appointments.outcomes == {("inflight", "early"): 1}
    engine.run_until(0.3)
    assert isinstance(admission.decide(0.3, ask(11, 2)), Grant)  # in its window: its request is enough


def test_a_request_id_names_its_client_even_before_its_window() -> None:
    """An NDJSON frame's id and prompt (a unique identity) re-sent early is that client: told the
    time left, its appointment kept, not booked twice."""
    admission, engine = one_running()
    first = admission.decide(0.0, ask(11, 7, unique=True))
    assert isinstance(first, Refusal) and first.hint_ms == 300
    booked = first.appointment
    again = admission.decide(0.1, ask(11, 7, unique=True))
    assert isinstance(again, Refusal) and again.hint_ms == 200 and again.appointment is booked
    book = admission.inflight.book
    assert book is not None and len(book.entries) == 1


def test_clients_sending_the_same_request_each_get_an_appointment_and_are_told_apart_in_turn() -> None:
    """A load generator's fixed prompt: the same identity from several clients. Before its window
    a frame without a ticket is a new client (booked after the first); in the window the frame is
    the holder of the earliest open appointment."""
    admission, engine = one_running()
    first = admission.decide(0.0, ask(11, 7))
    assert isinstance(first, Refusal) and first.hint_ms == 300
    booked = first.appointment
    second = admission.decide(0.1, ask(11, 7))
    assert isinstance(second, Refusal) and second.hint_ms == 501 and second.appointment is not booked
    assert admission.appointments.outcomes == {}
    engine.run_until(0.3)
    assert isinstance(admission.decide(0.3, ask(11, 7)), Grant)
    assert booked is not None and booked.ticket not in admission.appointments.by_ticket  # the earlier one


def test_a_holder_whose_slot_frees_late_keeps_its_place_and_its_ticket() -> None:
    admission, engine = one_running()
    first = admission.decide(0.0, ask(11, 2))
    assert isinstance(first, Refusal) and first.hint_ms == 300
    booked = first.appointment
    second = admission.decide(0.0, ask(11, 3))
    assert isinstance(second, Refusal) and second.hint_ms == 601
    later = second.appointment
    assert booked is not None and later is not None
    engine.run_until(0.29)  # the request it waits for runs late: its last token is not there at 0.3
    again = admission.decide(0.3, ask(11, 2, ticket=booked.ticket))
    # told half a window: its new window is open from now, ahead of the appointment made after it
    assert isinstance(again, Refusal) and again.appointment is booked and again.hint_ms == 25
    assert booked.at < later.at
    assert admission.appointments.outcomes == {("inflight", "yielded_again"): 1}
    engine.run_until(0.31)  # the late request ends: its slot is kept for the holder, not a newcomer
    assert isinstance(admission.decide(0.31, ask(11, 4)), Refusal)
    assert isinstance(admission.decide(0.325, ask(11, 2, ticket=booked.ticket)), Grant)


def test_forged_reused_and_other_tenants_tickets_are_no_ticket() -> None:
    admission, engine = one_running()
    alice = Tenant("alice", TenantLimits(), admission.hints, 0.0)
    mallory = Tenant("mallory", TenantLimits(), admission.hints, 0.0)
    refused = admission.decide(0.0, ask(11, 2, tenant=alice))
    booked = refused.appointment if isinstance(refused, Refusal) else None  # read now: refusals are reused
    assert booked is not None
    ticket = booked.ticket
    engine.run_until(0.3)
    # forged; alice's ticket and identity (a door names the tenant in an identity: here the worst
    # case, a collision) sent as mallory: refused, and alice's appointment is still hers
    for frame in (ask(11, 3, ticket="forged"), ask(11, 2, ticket=ticket, tenant=mallory)):
        decision = admission.decide(0.3, frame)
        assert isinstance(decision, Refusal) and decision.appointment is not booked
    assert admission.appointments.by_ticket[ticket].tenant is alice
    admitted = admission.decide(0.3, ask(11, 5, ticket=ticket, tenant=alice))
    assert isinstance(admitted, Grant)
    admission.release(admitted, True)
    # used once: the same ticket again is nobody's
    assert admission.appointments.find(ticket, 0, False, alice, 0.31) is None


def test_a_no_show_idles_the_slot_for_the_window_only_and_is_counted_never() -> None:
    admission, engine = one_running()
    assert isinstance(admission.decide(0.0, ask(11, 2)), Refusal)
    engine.run_until(0.3)
    assert isinstance(admission.decide(0.3 + GRACE_S / 2 - 0.001, ask(11, 3)), Refusal)  # still kept
    admitted = admission.decide(0.3 + GRACE_S / 2 + 1e-9, ask(11, 4))  # the window closed
    assert isinstance(admitted, Grant)
    registry = admission.appointments
    assert registry.outcomes == {} and registry.lapsed  # remembered for a late return
    admission.release(admitted, True, 0.4)
    # nobody comes back (neither 2 nor 3, booked at 0.3 for the next slot): the next frame after
    # the memory counts them, and recognition stops
    admission.decide(0.3 + LAPSED_MEMORY_S + 1, ask(11, 9))
    assert registry.outcomes == {("inflight", "never"): 2}
    assert not registry.lapsed and not registry.by_ticket


def test_a_late_return_is_counted_and_treated_as_a_new_client() -> None:
    admission, engine = one_running()
    assert isinstance(admission.decide(0.0, ask(11, 2)), Refusal)
    engine.run_until(1.0)
    assert isinstance(admission.decide(1.0, ask(11, 2)), Grant)
    assert admission.appointments.outcomes == {("inflight", "late"): 1}


def test_a_holder_back_a_little_late_keeps_its_promise() -> None:
    """Back within LATE_KEPT_S of its window's close (its timer fired late), inside its horizon:
    its appointment is booked again from then, with its ticket and its first refusal's horizon,
    and its return is counted `late` once, when it is admitted."""
    admission, engine = one_running()
    refused = admission.decide(0.0, ask(11, 2))
    assert isinstance(refused, Refusal) and refused.appointment is not None
    appointment, ticket = refused.appointment, refused.appointment.ticket
    engine.run_until(0.3)
    closes = appointment.closes
    newcomer = admission.decide(closes + 0.01, ask(11, 3))  # the window lapsed: the slot is anyone's
    assert isinstance(newcomer, Grant)
    engine.start(newcomer, closes + 0.01)
    engine.run_until(closes + LATE_KEPT_S / 2)
    back = admission.decide(closes + LATE_KEPT_S / 2, ask(11, 2, ticket=ticket))
    # no lobby here: told the next release (the newcomer's end), its appointment and horizon kept
    assert isinstance(back, Refusal) and back.appointment is appointment and appointment.booked_at == 0.0
    assert back.hint_ms == pytest.approx((closes + 0.01 + 0.3 - closes - LATE_KEPT_S / 2) * 1000, abs=2)
    engine.run_until(closes + 0.31)
    assert isinstance(admission.decide(appointment.at, ask(11, 2, ticket=appointment.ticket)), Grant)
    assert admission.appointments.outcomes == {("inflight", "yielded_again"): 1, ("inflight", "late"): 1}


def test_a_full_book_makes_no_promise() -> None:
    admission, engine, _ = governor(cap=1, first_s=0.1, step_s=0.02, tokens=11)
    book = admission.inflight.book
    assert book is not None
    book.max_entries = 2
    grant = admission.decide(0.0, ask(11, 1))
    assert isinstance(grant, Grant)
    engine.start(grant, 0.0)
    booked = []
    for i in range(3):
        decision = admission.decide(0.0, ask(11, 10 + i))  # a limit's refusal is reused: read it now
        booked.append(isinstance(decision, Refusal) and decision.appointment is not None)
    assert booked == [True, True, False]


def test_the_token_budget_books_the_time_its_tokens_are_given_back() -> None:
    endpoint = Endpoint("e", EndpointLimits(), now=0.0)
    endpoint.up = True
    # a horizon past 1.4 s: the large one below is booked too, not refused for good
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0, horizon_ms=2000), 8)
    admission = Admission([endpoint], Caps(max_inflight=8, max_inflight_tokens=100), hints, now=0.0)
    # What earlier requests taught: a first token 0.8 s after admission, then one every 0.1 s; so
    # a request asking for 3 tokens ends 0.8 + 2 x 0.1 = 1.0 s after its admission.
    model = admission.forecast.model(endpoint)
    model.first_token_s, model.step_s = 0.8, 0.1
    hints.observe_service_time(1.0)
    asks = ask(60, 1), ask(40, 2)
    for a in asks:
        a.max_new_tokens = 3
    first, second = admission.decide(0.0, asks[0]), admission.decide(0.5, asks[1])  # end at 1.0 and 1.5
    assert isinstance(first, Grant) and isinstance(second, Grant)
    small = admission.decide(0.6, ask(30, 3))  # needs 30 of the first one's 60: at 1.0
    assert isinstance(small, Refusal) and (small.reason, small.hint_ms) == ("tokens", 400)
    assert small.appointment is not None
    # needs 90 after the 30 promised: all 100 held now (at 1.5), and 20 of what the small one
    # takes at 1.0 and gives back a service time (and 1 ms) later
    large = admission.decide(0.6, ask(90, 4))
    assert isinstance(large, Refusal) and (large.reason, large.hint_ms) == ("tokens", 1401)
    assert large.appointment is not None and not large.final


def test_holders_are_told_to_come_early_by_their_lateness_within_half_a_window() -> None:
    registry = Appointments(0.05, RetryHintEstimator(RetryHintPolicy(), 8))
    assert registry.early_s == pytest.approx(0.001)  # nobody late yet: a millisecond
    registry.lateness_s = 0.004
    assert registry.early_s == pytest.approx(0.005)
    registry.lateness_s = 0.5  # never more than half the window: the holder still comes inside it
    assert registry.early_s == pytest.approx(0.025)


# -- properties -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    cap=st.integers(1, 4),
    tokens=st.integers(1, 6),
    gaps=st.lists(st.floats(0.0, 0.08), min_size=1, max_size=30),
)
def test_with_exact_service_times_every_on_time_return_is_admitted(cap: int, tokens: int, gaps: list[float]) -> None:
    """Clients arrive at random; every refused one comes back exactly at its hint (as a client
    honouring it does, to the millisecond), sending back its ticket: each is admitted."""
    admission, engine, _ = governor(cap, first_s=0.03, step_s=0.01, tokens=tokens)
    returns: list[tuple[float, int, str]] = []
    now = 0.0
    identities = itertools.count(1)

    def arrive(at: float, identity: int, ticket: str | None) -> None:
        engine.run_until(at)
        decision = admission.decide(at, ask(tokens, identity, ticket))
        if isinstance(decision, Grant):
            engine.start(decision, at)
            assert admission.inflight.inflight <= cap
            return
        assert ticket is None, f"an on-time return was refused at {at}: {decision!r}"
        if decision.final:  # past the promise horizon: told no for good, it does not come back
            assert decision.appointment is None and decision.hint_ms >= admission.horizon_ms
            return
        assert decision.appointment is not None
        heapq.heappush(returns, (at + decision.hint_ms / 1000, identity, decision.appointment.ticket))

    for gap in gaps:
        now += gap
        while returns and returns[0][0] <= now:
            arrive(*heapq.heappop(returns))
        arrive(now, next(identities), None)
    while returns:
        arrive(*heapq.heappop(returns))
    outcomes = admission.appointments.outcomes
    assert set(outcomes) <= {("inflight", "on_time")}


class AppointmentsMachine(RuleBasedStateMachine):
    """Arrivals, returns (on time, early, late, never, with forged or stolen tickets), and the
    engine's releases, in any order: caps hold, no appointment is promised twice, a slot is kept
    for an appointment only inside its window, and every return is counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.cap = 2
        self.admission, self.engine, _ = governor(self.cap, first_s=0.03, step_s=0.01, tokens=4)
        self.now = 0.0
        self.identities = itertools.count(1)
        self.appointments: list[Appointment] = []
        self.returns = 0

    def decide(self, a: Ask) -> Grant | Refusal:
        self.engine.run_until(self.now)
        decision = self.admission.decide(self.now, a)
        if isinstance(decision, Grant):
            self.engine.start(decision, self.now)
        elif decision.appointment is not None and decision.appointment not in self.appointments:
            self.appointments.append(decision.appointment)
        return decision

    @rule()
    def arrive(self) -> None:
        self.decide(ask(4, next(self.identities)))

    @rule(dt=st.floats(0.0, 0.1))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.engine.run_until(self.now)

    @rule(data=st.data(), how=st.sampled_from(["ticket", "identity", "forged", "stolen"]))
    def come_back(self, data: st.DataObject, how: str) -> None:
        if not self.appointments:
            return
        appointment = data.draw(st.sampled_from(self.appointments))
        other = Tenant("other", TenantLimits(), self.admission.hints, 0.0)
        frames = {
            "ticket": ask(4, 0, appointment.ticket),
            "identity": ask(4, appointment.identity),
            "forged": ask(4, next(self.identities), "forged-" + appointment.ticket),
            "stolen": ask(4, next(self.identities), appointment.ticket, tenant=other),
        }
        self.returns += how in ("ticket", "identity")
        self.decide(frames[how])

    @invariant()
    def caps_hold_and_promises_are_single(self) -> None:
        admission = self.admission
        assert 0 <= admission.inflight.inflight <= self.cap
        book = admission.inflight.book
        assert book is not None
        tickets = [entry.ticket for entry in book.entries]
        assert len(tickets) == len(set(tickets))
        registry = admission.appointments
        assert set(registry.by_ticket) == set(tickets)
        assert abs(book.promised - len(book.entries)) < 1e-9
        assert all(entry.closes > entry.at for entry in book.entries)
        # a slot is kept only for appointments inside their window, never more than the cap
        held = book.held(self.now, None)
        assert held <= len(book.entries)
        assert all(entry.opened(self.now) for entry in book.entries[: int(held)])

    @invariant()
    def every_return_is_counted_at_most_once(self) -> None:
        counted = sum(n for (_, outcome), n in self.admission.appointments.outcomes.items() if outcome != "never")
        assert counted <= self.returns


TestAppointmentsMachine = AppointmentsMachine.TestCase
TestAppointmentsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_flood_that_never_comes_back_stops_appointments_from_keeping_capacity() -> None:
    """Hundreds of clients refused and gone: their appointments lapse one after another, trust
    falls, and the capacity they were promised is anyone's again long before their horizon."""
    admission, engine, _ = governor(cap=2, first_s=0.01, step_s=0.001, tokens=10)  # 19 ms each
    for i in range(2):
        grant = admission.decide(0.0, ask(10, 1000 + i))
        assert isinstance(grant, Grant)
        engine.start(grant, 0.0)
    for i in range(400):  # the flood: each refused and booked, none ever returns
        assert isinstance(admission.decide(0.0, ask(10, i)), Refusal)
    book = admission.inflight.book
    assert book is not None and book.trust[STANDARD_RANK] >= MIN_TRUST
    now, admitted_at = 0.0, None
    while admitted_at is None and now < 10.0:
        now += 0.005
        engine.run_until(now)
        decision = admission.decide(now, ask(10, 9999))
        if isinstance(decision, Grant):
            admitted_at = now
            engine.start(decision, now)
    assert admitted_at is not None and admitted_at < 1.0, admitted_at  # not after the flood's horizon
    assert book.trust[STANDARD_RANK] < MIN_TRUST
    assert admission.appointments.trust_by_reason()["inflight"] < MIN_TRUST  # what the gauge shows
    # and a client that keeps its appointment brings keeping back
    for _ in range(40):
        admission.appointments.count(book, STANDARD_RANK, "on_time")
    assert book.trust[STANDARD_RANK] >= MIN_TRUST


def test_a_flood_of_one_class_that_never_comes_back_unbinds_only_its_own_appointments() -> None:
    """Trust is per book and rank: sheddable clients booked and gone lapse their rank's trust
    below one half; a critical client's appointment in the same book still keeps its slot."""
    admission, engine, _ = governor(cap=1, first_s=0.1, step_s=0.02, tokens=11)  # 0.3 s each
    book = admission.inflight.book
    assert book is not None
    # Ask.rank of each class whose tenant is not over its share (decision.py): 2 x its class rank + 1
    sheddable, critical = (2 * RANK[p] + 1 for p in (Priority.SHEDDABLE, Priority.CRITICAL))
    for _ in range(40):  # (what a flood of sheddable no-shows leaves: their rank's trust down)
        book.trust[sheddable] -= TRUST_WEIGHT * book.trust[sheddable]
    assert book.trust[sheddable] < MIN_TRUST <= book.trust[critical]
    holder = admission.decide(0.0, ask(11, 1))
    assert isinstance(holder, Grant)
    engine.start(holder, 0.0)
    frame = ask(11, 2)
    frame.rank = critical
    refused = admission.decide(0.05, frame)
    assert isinstance(refused, Refusal) and refused.appointment is not None
    engine.run_until(0.3)  # the slot frees: kept for the critical holder in its window
    newcomer = ask(11, 3)
    newcomer.rank = critical
    assert isinstance(admission.decide(0.3, newcomer), Refusal)
    shed = ask(11, 4)
    shed.rank = sheddable
    shed_refused = admission.decide(0.3, shed)
    assert isinstance(shed_refused, Refusal) and shed_refused.appointment is None  # its rank books nothing


def test_a_holder_refused_in_its_window_by_another_limit_gives_its_appointment_back() -> None:
    """Back on time for the full cap's slot, but its tenant's own rate refuses it: the slot is
    not kept idle until the window closes (a newcomer takes it at once), and the return counts
    `refused_elsewhere`, no lapse against the book's trust."""
    admission, engine = one_running()
    admission.set_tenancy({"a": TenantLimits(max_qps=1.0, qps_burst=1.0)}, frozenset(), 0.8, CeilingPolicy(), 0.0)
    tenant = admission.tenants.resolve("a")
    refused = admission.decide(0.05, ask(11, 2, tenant=tenant))
    assert isinstance(refused, Refusal) and refused.reason == "inflight"
    booked = refused.appointment
    assert booked is not None and refused.hint_ms == 250
    assert tenant.qps_bucket is not None
    tenant.qps_bucket.take()  # (another of a's frames took its rate's one token)
    engine.run_until(0.3)
    again = admission.decide(0.3, ask(11, 2, ticket=booked.ticket, tenant=tenant))
    assert isinstance(again, Refusal) and again.reason == "tenant_qps"
    assert admission.appointments.outcomes == {("inflight", "refused_elsewhere"): 1}
    assert admission.inflight.book is not None and not admission.inflight.book.entries
    assert isinstance(admission.decide(0.3, ask(11, 3)), Grant)  # the slot is anyone's at once


def test_a_holder_booked_again_by_another_limit_keeps_its_first_refusal_time() -> None:
    """One appointment per client, and one promise: a holder of one book refused in its window
    by another limit that books it anew is promised from its first refusal on, so it is told no
    for good once that is past the horizon (1 s), not promised a second horizon."""
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0), 8)
    registry = Appointments(GRACE_S, hints)
    first_book = AppointmentBook("endpoint_inflight", registry, True, lambda at, need, deficit, ahead: at + 0.3)
    second_book = AppointmentBook("inflight", registry, True, lambda at, need, deficit, ahead: at + 0.3)

    def client(holding: Appointment | None) -> Ask:
        held = Ask()
        held.identity, held.appointment = 7, holding
        return held

    _, first = first_book.refuse(0.0, client(None), 1.0, 1.0)
    assert first is not None and first.booked_at == 0.0
    _, again = second_book.refuse(0.3, client(first), 1.0, 1.0)  # back in its window, refused elsewhere
    assert again is not None and again.booked_at == 0.0 and not first_book.entries
    hint_ms, final = first_book.refuse(0.6, client(again), 1.0, 1.0)  # 0.6 + 0.3 is 0.9 s from its first: kept
    assert final is not None and final.booked_at == 0.0
    hint_ms, none = second_book.refuse(0.9, client(final), 1.0, 1.0)  # 0.9 + 0.3 s: past the horizon
    assert none is None and hint_ms >= 1000


def test_while_a_rank_keeps_nothing_probes_are_booked_and_their_returns_bring_trust_back() -> None:
    """Trust fell below one half: most refusals of that rank book nothing, but one in PROBE_EVERY
    still does; its client coming back on time raises trust again, so keeping can resume."""
    admission, engine = one_running()  # one slot, freed at 0.3 s
    book = admission.inflight.book
    assert book is not None
    book.trust[STANDARD_RANK] = 0.3
    booked = []
    for i in range(2 * PROBE_EVERY):
        refused = admission.decide(0.05, ask(11, 100 + i))
        assert isinstance(refused, Refusal)
        if refused.appointment is not None:
            booked.append(refused.appointment)
    assert len(booked) == 2  # one probe in every PROBE_EVERY refusals
    assert admission.decide(0.05, ask(11, 999)).appointment is None  # type: ignore[union-attr]
    engine.run_until(booked[0].at)
    before = book.trust[STANDARD_RANK]
    back = admission.decide(booked[0].at, ask(11, 0, ticket=booked[0].ticket))
    assert isinstance(back, Grant)
    assert book.trust[STANDARD_RANK] > before


def test_an_appointment_ranks_as_its_tenant_stands_when_the_book_is_consulted() -> None:
    """Booked while its tenant was at its fair share, an appointment ranks lower once that tenant
    has gone over it: in its window it no longer keeps the slot from a tenant at its share."""
    admission, engine, _ = governor(cap=1, first_s=0.1, step_s=0.02, tokens=11)  # 0.3 s each
    admission.set_tenancy({"a": TenantLimits(), "b": TenantLimits()}, frozenset(), 0.8, CeilingPolicy(), 0.0)
    a, b = admission.tenants.resolve("a"), admission.tenants.resolve("b")
    running = admission.decide(0.0, ask(11, 1, tenant=a))
    assert isinstance(running, Grant)
    engine.start(running, 0.0)
    refused = admission.decide(0.05, ask(11, 2, tenant=a))  # a alone contends: at its share
    assert isinstance(refused, Refusal) and refused.appointment is not None
    booked = refused.appointment
    assert booked.rank == STANDARD_RANK and refused.hint_ms == 250
    engine.run_until(0.3)  # the slot frees, in a's window
    # b contends, served less than a for its weight: a is over its share now.
    b.service, b.contending_until = a.service - 6.0, 10.0
    admitted = admission.decide(0.3, ask(11, 3, tenant=b))
    assert isinstance(admitted, Grant)  # a's appointment, ranked as a stands now, kept nothing from b
    assert booked.rank == STANDARD_RANK - 1


@pytest.mark.parametrize(("wait_ms", "promised"), [(199.5, False), (198.5, True)])
def test_a_wait_that_rounds_up_to_the_horizon_is_no_promise(wait_ms: float, promised: bool) -> None:
    """The hint is told in whole milliseconds, rounded up: a release 199.5 ms away is a 200 ms
    hint, at the horizon, so the refusal is final; 198.5 ms is 199, inside it, and booked."""
    endpoint = Endpoint("e", EndpointLimits(), now=0.0)
    endpoint.up = True
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0, horizon_ms=200.0), 1)
    admission = Admission([endpoint], Caps(max_inflight=1), hints, now=0.0, appointment_grace_s=GRACE_S)
    model = admission.forecast.model(endpoint)
    model.first_token_s, model.step_s = 0.1, 0.02
    hints.observe_service_time(0.3)
    grant = admission.decide(0.0, ask(11, 1))  # ends at 0.3 s, as forecast
    assert isinstance(grant, Grant)
    engine = Engine(admission, 0.1, 0.02, 11)
    engine.start(grant, 0.0)
    now = 0.3 - wait_ms / 1000
    engine.run_until(now)  # its first token seen: the release is forecast exactly
    refused = admission.decide(now, ask(11, 2))
    assert isinstance(refused, Refusal)
    assert (refused.appointment is not None) == promised
    if refused.appointment is not None:
        assert refused.appointment.at - refused.appointment.booked_at < 0.2
        assert refused.hint_ms == 199
