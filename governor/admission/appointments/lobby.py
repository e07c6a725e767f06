"""The lobby: a client that comes back for its appointment before its capacity is free waits here
instead of being told a new time.

A refused client is told to be back by a little before its slot's forecast release
(books.py: "be here by"). When it comes back inside its window and the capacity
kept for it is not free yet (the forecast was early by a fraction of a token, or the client
came early on purpose), `Admission.decide` answers `HOLD` rather than a new hint, and the door
parks the frame here with the callback that renders its answer. A held frame is decided again
each time capacity may have come back (`freed`: from the lifecycle's settle, at the end of an
endpoint's 429/503 pause, after a reload's new caps), holders in the
order of their appointments, and answered with the first decision that is not a hold: admitted,
or refused by another limit. It is decided a last time (its appointment's LAST_CALL) at the promise
horizon from its first refusal (or when its window closes, if that is later): the holder is here,
so holding it costs no capacity (the capacity is kept for it either way), and a forecast early by
a fraction of a token, or by a prefill that stalled the batch, keeps it rather than sending it
away; a no-show's window stays the grace. Not admitted by then, it is refused for good: a promise
is made once, and no client waits on the governor's promises longer than the horizon.

Only returning clients are held (a first arrival always gets an answer at once), so the promise
"never queued" becomes "a returning client may wait, at most until its promise horizon". Bounded: one entry per
open appointment (a second frame for a held appointment is a new client, registry.py), one timer
each. A held client that leaves gives its appointment back (`leave`); a drain answers every held
frame (`answer_all`). The doors own what a held frame is on their connection; the decisions are
admission's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from governor.admission.appointments.appointment import Appointment
from governor.admission.appointments.books import HOLD
from governor.admission.cost import Ask
from governor.admission.limits import Grant, Refusal
from governor.latency import Histogram
from governor.timers import Cancellable, Timers
from govwire.errors import RequestRejected

if TYPE_CHECKING:
    from governor.admission.decision import Admission

log = logging.getLogger("governor.lobby")

LAST_CALL_S = 0.01
"""A held frame is decided a last time this long before its promise horizon runs out, counted from
its first refusal here: so that its client, which counts from its own first attempt, hears the
answer within the horizon, the transit each way and its SDK's own work included (a few
milliseconds on loopback; 4 ms past the horizon at p99 in benchmarks.peers.sdk_overload with 1 ms)."""

LOBBY_WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Seconds a held frame waited for its answer."""

Decide = Callable[[float, Ask], Grant | Refusal]
"""Decides a frame now (raising `OverBudget`), a displacement carried out."""

Answer = Callable[[Grant | Refusal | RequestRejected, float], None]
"""Renders a held frame's decision on its connection (read at once: a refusal is reused), with
when it was first held."""


class Held:
    """One frame held for its appointment."""

    __slots__ = ("appointment", "ask", "answer", "timer", "since", "deadline_s")

    def __init__(self, appointment: Appointment, ask: Ask, answer: Answer, since: float) -> None:
        self.appointment = appointment
        self.ask = ask
        self.answer = answer
        self.timer: Cancellable | None = None
        self.since = since
        self.deadline_s = ask.deadline_s  # as it came: what is left of it shrinks while it is held


class Lobby:
    __slots__ = ("_admission", "_decide_again", "_timers", "_clock", "_held", "_waking", "wait")

    def __init__(self, admission: Admission, decide: Decide, timers: Timers, clock: Callable[[], float]) -> None:
        self._admission = admission
        # How a held frame is decided again: as a new one is (the lifecycle's `decide`, which
        # carries out a displacement), never a step of its own.
        self._decide_again = decide
        self._timers = timers
        self._clock = clock
        self._held: dict[Appointment, Held] = {}
        self._waking = False  # a wake-up is scheduled
        self.wait = Histogram(LOBBY_WAIT_BUCKETS)  # governor_lobby_wait_seconds
        if not admission.appointments.lobby:  # (its books would never answer HOLD)
            raise ValueError("admission was built to decide alone (Admission(..., served=True) holds)")

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, ask: Ask, appointment: Appointment, answer: Answer) -> Held:
        """Park the frame `decide` answered HOLD for `appointment` until it is decided otherwise."""
        now = self._clock()
        held = Held(appointment, ask, answer, now)
        appointment.hold(now)
        self._held[appointment] = held
        # Held until the promise horizon from its first refusal (or its window's close, if later).
        last = appointment.booked_at + self._admission.horizon_ms / 1000.0
        if last < appointment.closes:
            last = appointment.closes
        delay = last - now - LAST_CALL_S
        held.timer = self._timers.call_later(delay if delay > 0 else 0.0, self._last_call, held)
        return held

    def freed(self) -> None:
        """Capacity was released: the held frames are decided again on the next turn of the loop
        (never inside the settle that freed it)."""
        if self._held and not self._waking:
            self._waking = True
            self._timers.call_later(0.0, self._wake)

    def _wake(self) -> None:
        self._waking = False
        now = self._clock()
        for held in sorted(self._held.values(), key=_by_appointment):
            if held.appointment in self._held:  # (an answer may have made another leave)
                self._decide(held, now)

    def _last_call(self, held: Held) -> None:
        held.timer = None
        if self._held.get(held.appointment) is held:
            held.appointment.call_last()
            self._decide(held, self._clock())

    def _decide(self, held: Held, now: float) -> None:
        appointment, ask = held.appointment, held.ask
        ask.appointment = appointment  # (the book keeps it while it is held: never swept)
        if held.deadline_s is not None:  # a deadline counts from the frame's arrival, the hold included
            ask.deadline_s = held.deadline_s - (now - held.since)
        decision: Grant | Refusal | RequestRejected
        try:
            decision = self._decide_again(now, ask)
        except RequestRejected as exc:  # OverBudget: caps were lowered (reload) while it waited
            decision = exc
        if type(decision) is Refusal and decision.hint_ms == HOLD:
            return  # still not free: it waits on
        self._remove(held)
        if type(decision) is not Grant and not (type(decision) is Refusal and decision.appointment is appointment):
            self._give_back(appointment)  # refused (by another limit, or for good): the promise is void
        self.wait.observe(now - held.since)
        try:
            held.answer(decision, held.since)
        except Exception:  # a bug in rendering must not stop the other held frames' answers
            log.exception("event=internal_error where=lobby_answer")

    def _remove(self, held: Held) -> None:
        appointment = held.appointment
        del self._held[appointment]
        appointment.unhold()
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None

    def leave(self, held: Held) -> None:
        """Its client is gone: its appointment goes back (the capacity is anyone's), unanswered."""
        if self._held.get(held.appointment) is not held:
            return
        self._remove(held)
        self._give_back(held.appointment)
        self.freed()  # what it kept may let another holder in

    def _give_back(self, appointment: Appointment) -> None:
        """Out of its book, if it is still there (a refusal may have moved or removed it)."""
        if appointment.live:
            appointment.book.remove(appointment)

    def answer_all(self) -> None:
        """Decide every held frame now (a drain: each is told `draining`)."""
        now = self._clock()
        for held in sorted(self._held.values(), key=_by_appointment):
            held.appointment.call_last()
            self._decide(held, now)


def _by_appointment(held: Held) -> float:
    return held.appointment.at
