"""Displacement before the first token: a frame of a higher class that meets the full in-flight
cap takes the slot of an admitted request of a lower class that has not started yet.

Refusing is final for an open-loop critical client, and at a small cap a class ceiling cannot
hold enough headroom for a critical burst without idling it the rest of the time. Yet right
after admission a request only waits in its endpoint's queue for its first step: cancelling it
there costs the engine nothing and the client a retry, since nothing was streamed. So when a
`critical` frame (or a `standard` one, over `sheddable` work) is refused by the global in-flight
cap, the newest admitted request of the lowest class below it that has no first token yet is
cancelled in its worker and settled at once with a `yield`, reason `preempted` — with a retry
hint and an appointment, as any refusal by the cap — and its slot goes to the newcomer in the same
turn. The governor's in-flight count never exceeds the cap: the victim is
settled before the newcomer is charged (its worker holds one more request until the cancel lands
at its next step boundary, as with an expired deadline).

The rules (vLLM's and SGLang's: never break a stream): never a request that streamed a token,
never between equal classes (no ping-pong), never a request twice (it is settled; a victim that
comes back with its appointment is not a candidate again), never a critical request, and at most
one displacement per release gap by each class, so that a burst of critical frames cannot empty
the lower classes faster than the engine frees slots (and standard frames displacing sheddable
work do not use up the turn of a critical frame). `--preempt off` turns it off.

This module keeps the candidates, in admission order per class; Admission.decide picks a victim
and answers `Displace(victim)`, which the lifecycle carries out (`Lifecycle.decide`): it ends the
victim, then admission decides the frame again (`Admission.after_displacing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from governor.admission.cost import Ask
from governor.admission.limits import Grant
from governor.admission.priority import RANK
from govwire.vocab import DEFAULT_TENANT, Priority

if TYPE_CHECKING:
    from governor.admission.appointments.appointment import Appointment

Answer = Callable[[int, "Appointment | None"], None]
"""Renders the victim's `yield` (its hint in ms, and its appointment if one was booked)."""


class Displace:
    """Admission's answer when a higher-class frame can be let in by displacing `victim`, a
    request of a lower class that has not started: data, carried out by whoever runs requests (the
    lifecycle's `decide`): settle the victim (its capacity comes back), then
    `Admission.after_displacing` decides the frame again on what it freed and books the victim's
    hint, which `Answer` tells its client."""

    __slots__ = ("victim",)

    def __init__(self, victim: Grant) -> None:
        self.victim = victim


class Displacement:
    """The `Limit` (limits.py) that follows the displaceable requests (admitted, not started, not
    critical) and picks a victim. It never refuses. Charged only once frames of more than one
    class came (Admission._activate), so a governor whose clients send no `priority` pays nothing."""

    __slots__ = ("enabled", "served", "total", "_waiting", "_next_at")

    def __init__(self, served: bool = False) -> None:
        self.enabled = True  # --preempt
        self.served = served  # a lifecycle carries out its displacements; else nobody can end a victim
        self.total: dict[tuple[str, str], int] = {}  # displaced requests by (class, tenant)
        # By class rank (sheddable, standard): the displaceable requests, oldest first.
        self._waiting: tuple[dict[int, Grant], ...] = ({}, {})
        self._next_at = [-math.inf] * len(RANK)  # by the displacing class: the earliest time of its next

    @property
    def armed(self) -> bool:
        return self.enabled and self.served

    def victim(self, now: float, ask: Ask) -> Grant | None:
        """The request `ask` may displace now: the newest of the lowest class below its own that
        has not started; None when there is none, or the last displacement by its class was
        under a release gap ago."""
        own = RANK[ask.priority]
        if now < self._next_at[own]:
            return None
        waiting = self._waiting
        for rank in range(min(own, len(waiting))):
            grants = waiting[rank]
            if grants:
                return grants[next(reversed(grants))]
        return None

    def displaced(self, grant: Grant, now: float, gap_s: float, by: Priority) -> None:
        """`grant` is being displaced by a frame of class `by`: no longer a candidate; the next
        displacement by that class waits a release gap."""
        self._forget(grant)
        self._next_at[RANK[by]] = now + gap_s
        ask = grant.ask
        key = (ask.priority.value, ask.tenant.name if ask.tenant is not None else DEFAULT_TENANT)
        self.total[key] = self.total.get(key, 0) + 1

    # -- a Limit that never refuses ---------------------------------------------------------------

    def check(self, now: float, ask: Ask) -> None:
        return None

    def charge(self, grant: Grant, now: float) -> None:
        ask = grant.ask
        priority = ask.priority
        if priority is Priority.CRITICAL:
            return
        appointment = ask.appointment
        if appointment is not None and appointment.displaced:
            return  # a victim coming back: never displaced twice
        self._waiting[RANK[priority]][id(grant)] = grant

    def started(self, grant: Grant) -> None:
        self._forget(grant)

    def refund(self, grant: Grant) -> None:
        return None  # it leaves with `release`

    def release(self, grant: Grant, executed: bool) -> None:
        self._forget(grant)

    def _forget(self, grant: Grant) -> None:
        priority = grant.ask.priority
        if priority is not Priority.CRITICAL:
            self._waiting[RANK[priority]].pop(id(grant), None)

    def __len__(self) -> int:
        return sum(len(grants) for grants in self._waiting)
