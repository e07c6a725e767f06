"""The appointment's state machine (admission/appointments/appointment.py): every transition its
phase allows, and none it does not, whatever order they are tried in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.admission.appointments.appointment import Appointment, AppointmentError, Phase
from governor.admission.appointments.books import AppointmentBook
from governor.admission.appointments.registry import Appointments
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy

LIVE = {Phase.BOOKED, Phase.HELD, Phase.LAST_CALL}
ALLOWED: dict[str, set[Phase]] = {
    "hold": {Phase.BOOKED},
    "call_last": {Phase.HELD, Phase.LAST_CALL},
    "redeem": LIVE,
    "lapse": {Phase.BOOKED},
    "give_back": LIVE,
    "rebook": {Phase.GIVEN_BACK, Phase.LAPSED},
}
AFTER = {
    "hold": Phase.HELD,
    "call_last": Phase.LAST_CALL,
    "redeem": Phase.REDEEMED,
    "lapse": Phase.LAPSED,
    "give_back": Phase.GIVEN_BACK,
    "rebook": Phase.BOOKED,
}


def appointment() -> Appointment:
    registry = Appointments(0.05, RetryHintEstimator(RetryHintPolicy(), 8))
    book = AppointmentBook("inflight", registry, True, lambda at, need, deficit, ahead: None)
    return Appointment(1.0, 1.0, book, None, 0)


def step(one: Appointment, name: str) -> None:
    if name == "hold":
        one.hold(2.0)
    elif name == "rebook":
        one.rebook(3.0)
    elif name == "unhold":
        one.unhold()
    else:
        getattr(one, name)()


@given(st.lists(st.sampled_from([*ALLOWED, "unhold"]), max_size=12))
def test_a_transition_happens_only_from_the_phases_that_allow_it(names: list[str]) -> None:
    one = appointment()
    for name in names:
        before = one.phase
        if name == "unhold":  # answered: back to booked if it was held, else unchanged
            one.unhold()
            assert one.phase is (Phase.BOOKED if before in (Phase.HELD, Phase.LAST_CALL) else before)
        elif before in ALLOWED[name]:
            step(one, name)
            assert one.phase is AFTER[name]
        else:
            with pytest.raises(AppointmentError):
                step(one, name)
            assert one.phase is before  # a refused transition changes nothing
        assert one.live == (one.phase in LIVE)
        assert one.in_lobby == (one.phase in (Phase.HELD, Phase.LAST_CALL))
        assert one.last_call == (one.phase is Phase.LAST_CALL)


def test_a_held_appointment_remembers_when_its_holder_came_and_a_rebooked_one_its_new_time() -> None:
    one = appointment()
    one.hold(2.5)
    assert one.came_at == 2.5 and one.in_lobby and one.live
    one.give_back()
    one.rebook(4.0)
    assert one.at == 4.0 and one.phase is Phase.BOOKED and one.booked_at == 1.0  # its promise counts from then
