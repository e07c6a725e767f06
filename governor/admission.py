"""The admission decision: one object owns every limit and answers each generate frame at once.

`decide(now)` checks every limit and then charges every limit (limits.py), so a frame is either
admitted with a `Grant` (its endpoint) or refused with a `Refusal` (reason and retry hint) and no
trace on any limit. The order of the limits is the order of the reasons a client sees when
several would refuse: draining first, then the global concurrency and rate caps, then the
endpoint pool (which also routes). `refund` undoes a grant whose frame turned out invalid,
`release` frees what a running request held once it has ended, and `reroute` moves a request
whose endpoint was lost to another one without charging the global limits again.

The ingress only parses, calls `decide` and encodes the answer; new limits (token budgets,
tenant caps, class ceilings, fleet leases) are added here.
"""

from __future__ import annotations

from collections.abc import Callable

from governor.endpoint import Endpoint
from governor.hints import RetryHintEstimator
from governor.limits import Draining, Grant, InflightLimiter, Limit, RateLimit, Refusal
from governor.pool import Pool


class Admission:
    __slots__ = ("hints", "drain", "inflight", "rate", "pool", "_every", "_limits", "_checks")

    def __init__(
        self,
        endpoints: list[Endpoint],
        max_inflight: int,
        qps: float,
        burst: float,
        hints: RetryHintEstimator,
        now: float,
    ) -> None:
        self.hints = hints
        self.drain = Draining(hints)
        self.inflight = InflightLimiter(max_inflight, hints)
        self.rate = RateLimit(qps, burst, now)
        self.pool = Pool(endpoints, max_inflight, hints)
        self._every: tuple[Limit, ...] = (self.drain, self.inflight, self.rate, self.pool)
        self._limits: tuple[Limit, ...] = ()
        self._checks: tuple[Callable[[float], Refusal | None], ...] = ()
        self._activate()

    def _activate(self) -> None:
        """The limits that can refuse now, in order: draining only while draining, the rate cap
        only when there is one. Every frame runs their checks, so none is there for nothing."""
        limits: list[Limit] = [self.drain] if self.drain.draining else []
        limits.append(self.inflight)
        if self.rate.bucket is not None:
            limits.append(self.rate)
        limits.append(self.pool)
        self._limits = tuple(limits)
        self._checks = tuple(limit.check for limit in limits)

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def start_draining(self) -> None:
        """From now on every frame yields with reason `draining`."""
        self.drain.draining = True
        self._activate()

    def set_caps(self, max_inflight: int, qps: float, burst: float, now: float) -> None:
        """Live change (SIGHUP). Lowering a cap never cancels a running request: it stops new
        admissions until in-flight falls under it."""
        self.inflight.set_max(max_inflight)
        self.rate.set_rate(qps, burst, now)
        self.pool.default_capacity = max_inflight
        self._activate()

    def decide(self, now: float) -> Grant | Refusal:
        """A refusal is the refusing limit's own object (limits.Refusal): read it at once."""
        for check in self._checks:
            refusal = check(now)
            if refusal is not None:
                return refusal
        grant = Grant()
        for limit in self._limits:
            limit.charge(grant, now)
        return grant

    def refund(self, grant: Grant) -> None:
        """The admitted frame will not run: give back what `charge` took (its slots go with `release`).
        Every limit is asked, active or not: one may have been switched off since the charge."""
        for limit in self._every:
            limit.refund(grant)

    def release(self, grant: Grant, executed: bool) -> None:
        for limit in self._every:
            limit.release(grant, executed)

    def reroute(self, grant: Grant, now: float) -> bool:
        """Route a request whose endpoint was lost before it started to another endpoint: the old
        endpoint's slot is freed (as failed) and the new one charged; the global limits keep what
        they charged. False, changing nothing, when no other endpoint can take it now."""
        pool = self.pool
        if self.drain.draining or pool.check(now) is not None:
            return False
        old = Grant()
        old.endpoint, grant.endpoint = grant.endpoint, None
        pool.charge(grant, now)
        if grant.endpoint is None:  # no endpoint is up
            grant.endpoint = old.endpoint
            return False
        pool.release(old, executed=False)
        return True

    def refund_reroute(self, grant: Grant) -> None:
        """The re-routed dispatch failed: give back the new endpoint's token (the global limits
        charged nothing for the move); its slot goes with `release`."""
        self.pool.refund(grant)
