"""Priority classes: how close to each cap a frame of each class may be admitted.

A frame's `priority` is `critical`, `standard` (the default) or `sheddable`. Each class has a
ceiling, a fraction of every cap (global and per tenant: requests, token budgets, rate buckets):
a sheddable frame is admitted only while the admission keeps each cap under the sheddable
ceiling (default 80%), a standard one under 95%, a critical one up to the hard cap.

A ceiling is a gate, not a reservation: it applies only while a frame of a higher class is
being turned away — one was refused within the last `hold_s` (1 s by default; at least a release
gap, the mean time between two releases at saturation), or holds an appointment whose window has
not closed. Then the next releases go to the higher class, and the classes below yield first.
A second rather than one release gap because a refused client that does not come back (an
open-loop caller) leaves no appointment behind: held one gap, the gate would reopen before the
next critical frame comes (docs/benchmarks/sittings.md experiment 9 measures both). When no higher-class
frame is short of capacity, every class may fill every cap: capacity held for
nobody would be capacity lost (the Gateway API Inference Extension's priority holdback, rather
than a fixed reservation). A critical frame that meets a full cap may also displace a request of
a lower class that has not started (displacement.py).

A ceiling keeps the next releases for critical work, but at the start of a burst nothing is
released for a whole service time, and critical frames arriving then are refused whatever the
gates say (Erlang B: 8 slots at 4 erlangs of critical load refuse 3% of first attempts). The only
lever there is capacity past the cap: `critical_allowance` (`--class-allowance critical=D`, opt-in
like a tenant's `guaranteed_inflight`) admits critical frames past `--max-inflight` while fewer
than cap + D requests are in flight, so their first attempts are refused about as often as
B(cap + D, load) says, at the price of a batch up to D larger while they use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from govwire.vocab import Priority

_CRITICAL, _STANDARD, _SHEDDABLE = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE

RANK: dict[Priority, int] = {_SHEDDABLE: 0, _STANDARD: 1, _CRITICAL: 2}
"""The classes in order: a higher rank is admitted first and may displace a lower one."""

RANKS = 6
"""`Ask.rank`s: 2 x the class's `RANK`, plus 1 unless its tenant is over its fair share while
another contends. Appointments keep capacity against their rank and those below (appointments.py)."""

STANDARD_RANK = 3
"""`Ask.rank` of a standard frame whose tenant is not over its share."""


@dataclass(frozen=True, slots=True)
class CeilingPolicy:
    sheddable: float = 0.8
    standard: float = 0.95
    hold_s: float = 1.0  # how long a gate stays closed after a refusal (at least one release gap)
    critical_allowance: int = 0  # critical frames may be admitted this far past the in-flight cap

    def __post_init__(self) -> None:
        if not 0 < self.sheddable <= self.standard <= 1:
            raise ValueError("ceilings need 0 < sheddable <= standard <= 1")
        if not 0 <= self.hold_s < math.inf:
            raise ValueError("the ceiling hold must be finite and >= 0")
        if self.critical_allowance < 0:
            raise ValueError("a class allowance must be >= 0")

    def of(self, priority: Priority) -> float:
        """The class's ceiling when it applies."""
        return self.sheddable if priority is _SHEDDABLE else self.standard if priority is _STANDARD else 1.0


class PriorityCeilings:
    """The ceiling each frame gets, from its class and the higher-class frames refused lately.
    `ceiling` runs for every generate frame: plain attributes, no dict."""

    __slots__ = ("policy", "_critical_until", "_standard_until", "classes_seen", "on_classes")

    def __init__(self, policy: CeilingPolicy) -> None:
        self.policy = policy
        self._critical_until = -math.inf  # the gate for the classes below critical is closed until then
        self._standard_until = -math.inf  # ... and for sheddable, because of a standard frame
        # Whether a frame of another class than standard ever came: until then nobody outranks
        # anybody, and admission pays nothing for classes (`on_classes` tells it when one comes).
        self.classes_seen = False
        self.on_classes: Callable[[], None] | None = None

    def ceiling(self, priority: Priority, now: float) -> float:
        """The fraction of each cap a frame of `priority` arriving `now` may fill."""
        if priority is _STANDARD:
            return self.policy.standard if self._critical_until > now else 1.0
        if not self.classes_seen:
            self.classes_seen = True
            if self.on_classes is not None:
                self.on_classes()
        if priority is _CRITICAL:
            return 1.0
        return self.policy.sheddable if max(self._critical_until, self._standard_until) > now else 1.0

    def refused(self, priority: Priority, now: float, gap_s: float, due_until: float = -math.inf) -> None:
        """A frame of `priority` was refused capacity at `now`: the gates of the classes below it
        close for `hold_s` (at least a release gap), or until its appointment's window closes
        (`due_until`), whichever is later."""
        if priority is _SHEDDABLE:
            return
        until = now + max(gap_s, self.policy.hold_s)
        if due_until > until:
            until = due_until
        if priority is _CRITICAL:
            if until > self._critical_until:
                self._critical_until = until
        elif until > self._standard_until:
            self._standard_until = until

    def current(self, now: float) -> dict[str, float]:
        """Each class's ceiling now (stats and metrics)."""
        policy = self.policy
        critical, standard = self._critical_until > now, self._standard_until > now
        return {
            _CRITICAL.value: 1.0,
            _STANDARD.value: policy.standard if critical else 1.0,
            _SHEDDABLE.value: policy.sheddable if critical or standard else 1.0,
        }


def parse_allowance(text: str) -> tuple[Priority, int]:
    """`CLASS=D` (`--class-allowance`) -> the class and its allowance past the in-flight cap. Only
    critical takes one: the classes below yield to it, and an allowance of theirs would take what
    the gates keep for it."""
    name, sep, value = (part.strip() for part in text.partition("="))
    if not sep:
        raise ValueError(f"{text!r}: expected CLASS=D, e.g. critical=2")
    if name != _CRITICAL.value:
        raise ValueError(f"{name!r}: only critical takes an allowance past the cap")
    try:
        allowance = int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number of requests") from None
    if allowance < 0:
        raise ValueError(f"allowance {allowance} must be >= 0")
    return _CRITICAL, allowance
