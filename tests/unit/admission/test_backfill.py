"""Backfill (limits.InflightLimiter, AppointmentBook.due): a slot kept for an appointment further
away than a newcomer's forecast service time is lent to the newcomer; the appointment is still
kept, and a borrower that overruns its forecast leaves the holder held, never past the cap."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.admission.appointments.appointment import Phase
from governor.admission.appointments.books import HOLD
from governor.admission.caps import Caps
from governor.admission.cost import Ask
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant, Refusal

GRACE_S = 0.2
"""A window of ±100 ms: wider than a short request's service (40 ms), so a kept slot can be lent."""
FIRST_S, STEP_S = 0.01, 0.01
"""What earlier streams taught the forecast: a request of n tokens holds its slot 0.01 * n s."""


def admission(cap: int, served: bool = False) -> Admission:
    endpoint = Endpoint("e", EndpointLimits(), now=0.0)
    endpoint.up = True
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0), cap)
    made = Admission([endpoint], Caps(max_inflight=cap), hints, now=0.0, appointment_grace_s=GRACE_S, served=served)
    model = made.forecast.model(endpoint)
    model.first_token_s, model.step_s = FIRST_S, STEP_S
    hints.observe_service_time(0.3)
    return made


def ask(tokens: int, identity: int, ticket: str | None = None) -> Ask:
    a = Ask(max_new_tokens=tokens, cost=tokens)
    a.identity, a.ticket = identity, ticket
    return a


def kept_slot(served: bool = False) -> tuple[Admission, Grant, str]:
    """Cap 2, both taken at 0 by long requests; a third client refused at 0 and promised the
    first release (at 0.3 s, a service time on); then that release comes early, at 0.1 s: the
    slot is free, and from 0.2 s the window of the appointment opens and keeps it."""
    made = admission(2, served)
    first = made.decide(0.0, ask(30, 1))
    second = made.decide(0.0, ask(30, 2))
    assert isinstance(first, Grant) and isinstance(second, Grant)
    refused = made.decide(0.0, ask(30, 3))
    assert isinstance(refused, Refusal) and refused.appointment is not None
    assert abs(refused.appointment.at - 0.3) < 0.01
    made.release(first, True, 0.1)
    return made, second, refused.appointment.ticket


def test_a_short_newcomer_borrows_the_kept_slot_and_the_holder_still_gets_it_on_time() -> None:
    made, _, ticket = kept_slot()
    borrower = made.decide(0.22, ask(4, 10))  # 40 ms of service, due back at 0.26 s, before 0.3 s
    assert isinstance(borrower, Grant) and made.inflight.backfilled == 1
    made.release(borrower, True, 0.26)
    back = made.decide(0.3, ask(30, 3, ticket))
    assert isinstance(back, Grant)
    assert made.appointments.outcomes == {("inflight", "on_time"): 1}


def test_a_newcomer_that_would_still_run_at_the_appointment_is_refused() -> None:
    made, _, _ = kept_slot()
    refused = made.decide(0.22, ask(12, 10))  # 120 ms: past the appointment at 0.3 s
    assert isinstance(refused, Refusal) and refused.reason == "inflight"
    assert made.inflight.backfilled == 0


def test_nothing_is_lent_before_a_stream_taught_the_forecast_its_speed() -> None:
    made, _, _ = kept_slot()
    for model in made.forecast.models.values():
        model.step_s = None  # (as if no stream had ended: the speed is the prior's guess)
    assert made.forecast.service_of(ask(4, 10)) is None
    assert isinstance(made.decide(0.22, ask(4, 10)), Refusal)


def test_a_borrower_that_overruns_leaves_the_holder_held_and_its_slot_kept_from_everyone_else() -> None:
    made, _, ticket = kept_slot(served=True)
    borrower = made.decide(0.22, ask(4, 10))
    assert isinstance(borrower, Grant)
    # 0.3 s: the borrower still runs (it overran its 40 ms); the holder comes for its appointment
    holder = ask(30, 3, ticket)
    held = made.decide(0.3, holder)
    assert isinstance(held, Refusal) and held.hint_ms == HOLD
    appointment = held.appointment
    assert appointment is not None and appointment.live
    appointment.hold(0.3)  # (what the lobby does with a HOLD)
    assert appointment.phase is Phase.HELD
    # nobody else takes the slot when the borrower gives it back: the holder's appointment keeps it
    made.release(borrower, True, 0.35)
    fresh = made.decide(0.35, ask(4, 11))
    assert isinstance(fresh, Refusal) and fresh.hint_ms != HOLD
    back = made.decide(0.35, holder)  # decided again, as the lobby does when capacity frees
    assert isinstance(back, Grant)
    assert made.appointments.outcomes == {("inflight", "on_time"): 1} and not appointment.live
    assert made.inflight.inflight == 2  # never past the cap


class BackfillMachine(RuleBasedStateMachine):
    """Arrivals short and long, returns for appointments, requests that end early, on time or
    late (overrunning what the forecast said), in any order, with windows wide enough to lend:
    in-flight never exceeds the cap, every backfill was an admission, and what the open windows
    hold is never more than the appointments booked."""

    CAP = 3

    def __init__(self) -> None:
        super().__init__()
        self.admission = admission(self.CAP)
        self.now = 0.0
        self.running: list[Grant] = []
        self.tickets: list[str] = []
        self.ids = itertools.count(1)
        self.admitted = 0

    def decide(self, a: Ask) -> None:
        decision = self.admission.decide(self.now, a)
        if isinstance(decision, Grant):
            self.running.append(decision)
            self.admitted += 1
        elif isinstance(decision, Refusal) and decision.appointment is not None:
            self.tickets.append(decision.appointment.ticket)

    @rule(tokens=st.sampled_from([2, 4, 30]))
    def arrive(self, tokens: int) -> None:
        self.decide(ask(tokens, next(self.ids)))

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        self.decide(ask(30, next(self.ids), data.draw(st.sampled_from(self.tickets))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def one_ends(self, data: st.DataObject) -> None:
        grant = data.draw(st.sampled_from(self.running))
        self.running.remove(grant)
        self.admission.release(grant, True, self.now)

    @rule(dt=st.floats(0.0, 0.15))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def the_cap_holds_and_loans_are_admissions(self) -> None:
        inflight = self.admission.inflight
        assert inflight.inflight == len(self.running) <= self.CAP
        assert inflight.backfilled <= self.admitted
        book = inflight.book
        assert book is not None
        assert book.held(self.now, None) <= len(book.entries)
        assert all(entry.live for entry in book.entries)


TestBackfillMachine = BackfillMachine.TestCase
TestBackfillMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
