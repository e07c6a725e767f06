"""Priority classes: how close to each cap a frame of each class may be admitted.

A frame's `priority` is `critical`, `standard` (the default) or `sheddable`. Each class has a
ceiling, a fraction of every cap (global and per tenant: requests, token budgets, rate buckets):
a sheddable frame is admitted only while the admission keeps each cap under the sheddable
ceiling (default 80%), a standard one under 95%, a critical one up to the hard cap. As saturation
rises, sheddable traffic therefore yields first, then standard.

A ceiling holds headroom for the classes above it only while one of them is around: once a frame
of a higher class was seen within `hold_s`. A governor that serves one class uses all of its
capacity for it (a fraction of the caps held for nobody would be capacity lost); `hold_s` 0
holds the headroom always.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from govwire.vocab import Priority

_CRITICAL, _STANDARD, _SHEDDABLE = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


@dataclass(frozen=True, slots=True)
class CeilingPolicy:
    sheddable: float = 0.8
    standard: float = 0.95
    hold_s: float = 60.0  # a ceiling applies while a higher class was seen this recently; 0 = always

    def __post_init__(self) -> None:
        if not 0 < self.sheddable <= self.standard <= 1:
            raise ValueError("ceilings need 0 < sheddable <= standard <= 1")
        if not 0 <= self.hold_s < math.inf:
            raise ValueError("the ceiling hold must be finite and >= 0")

    def of(self, priority: Priority) -> float:
        """The class's ceiling when it applies."""
        return self.sheddable if priority is _SHEDDABLE else self.standard if priority is _STANDARD else 1.0


class PriorityCeilings:
    """The ceiling each frame gets, from its class and the classes seen lately. `ceiling` runs for
    every generate frame: plain attributes, no dict."""

    __slots__ = ("policy", "_critical_at", "_standard_at")

    def __init__(self, policy: CeilingPolicy) -> None:
        self.policy = policy
        self._critical_at = -math.inf  # when a critical frame came last
        self._standard_at = -math.inf  # when a standard one did

    def ceiling(self, priority: Priority, now: float) -> float:
        """The fraction of each cap a frame of `priority` arriving `now` may fill (and note that it came)."""
        if priority is _STANDARD:
            self._standard_at = now
            return self.policy.standard if self._holds(self._critical_at, now) else 1.0
        if priority is _CRITICAL:
            self._critical_at = now
            return 1.0
        higher = max(self._critical_at, self._standard_at)
        return self.policy.sheddable if self._holds(higher, now) else 1.0

    def _holds(self, higher_seen: float, now: float) -> bool:
        hold_s = self.policy.hold_s
        return not hold_s or higher_seen > now - hold_s

    def current(self, now: float) -> dict[str, float]:
        """Each class's ceiling now, without noting a frame (stats and metrics)."""
        policy = self.policy
        return {
            _CRITICAL.value: 1.0,
            _STANDARD.value: policy.standard if self._holds(self._critical_at, now) else 1.0,
            _SHEDDABLE.value: policy.sheddable if self._holds(max(self._critical_at, self._standard_at), now) else 1.0,
        }
