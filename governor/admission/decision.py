"""The admission decision: one object owns every limit and answers each generate frame at once.

`decide(now, ask)` checks every limit and then charges every limit (limits.py), so a frame is
either admitted with a `Grant` (its endpoint) or refused with a `Refusal` (reason and retry hint)
and no trace on any limit. The `Ask` is what the frame costs in tokens, its deadline (cost.py),
its tenant (tenant.py) and its priority class, whose ceiling (priority.py) sets the fraction of
each cap it may fill; a request that no budget could ever hold raises `OverBudget` before any
check. The order of the limits is the order of the reasons a client sees when several would
refuse: draining first, then the tenant's own caps, then the global concurrency, rate and token
caps, then the tenant's fair share (fair_share.py), then the endpoint pool (which also routes),
then the deadline (which predicts on the endpoint the pool chose). A refused tenant counts as
contending for capacity, whichever limit refused it. `refund` undoes
a grant whose frame turned out invalid, `release` frees what a running request held once it has
ended and settles its token cost, `started` records its first token (the TTFT model, the release
forecast and the adaptive limit learn from it), and `reroute` moves a request whose endpoint was lost to another
one without charging the global limits again.

Every admitted request is followed by the release forecast (release_forecast.py) until its end;
the in-flight cap and the token budget hint from it and keep appointments for the clients they
refuse (appointments.py). A frame that comes back for its appointment is recognised here, before
any limit is checked, and the limits holding the appointment let it in.

The doors only parse, call `decide` and render the answer; new limits are added here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from governor.admission.adaptive_limit import AdaptiveLimit, AdaptiveMode, AdaptivePolicy
from governor.admission.appointments import AppointmentBook, Appointments
from governor.admission.cost import NO_ASK, Ask
from governor.admission.deadline import DeadlineLimit
from governor.admission.endpoint import Endpoint
from governor.admission.fair_share import DEFAULT_SHARE_THRESHOLD, FairShare
from governor.admission.hints import RetryHintEstimator
from governor.admission.limits import (
    Draining,
    Grant,
    InflightLimiter,
    Limit,
    RateLimit,
    Refusal,
    SharedLimit,
    TokenBudget,
    TokenRate,
)
from governor.admission.pool import Pool
from governor.admission.priority import CeilingPolicy, PriorityCeilings
from governor.admission.release_forecast import NOTHING_PROMISED, ReleaseForecast
from governor.admission.tenant import TenantLimits, Tenants
from governor.admission.tenant_caps import TenantCaps
from govwire.errors import OverBudget
from govwire.vocab import YieldReason


class Admission:
    __slots__ = (
        "hints",
        "drain",
        "inflight",
        "rate",
        "tokens",
        "token_rate",
        "pool",
        "deadline",
        "adaptive",
        "tenants",
        "tenant_caps",
        "fair",
        "ceilings",
        "fleet",
        "max_inflight",
        "forecast",
        "appointments",
        "_sharing",
        "_every",
        "_limits",
        "_checks",
        "_fits",
    )

    def __init__(
        self,
        endpoints: list[Endpoint],
        max_inflight: int,
        qps: float,
        burst: float,
        hints: RetryHintEstimator,
        now: float,
        max_inflight_tokens: int = 0,
        tokens_per_s: float = 0.0,
        tokens_burst: float = 0.0,
        adaptive: AdaptivePolicy | None = None,
        appointment_grace_s: float = 0.05,
    ) -> None:
        self.hints = hints
        self.max_inflight = max_inflight  # as configured; the effective cap may be the adaptive one
        forecast = self.forecast = ReleaseForecast()
        registry = self.appointments = Appointments(appointment_grace_s, hints)
        self.drain = Draining(hints)
        booking = hints.policy.adaptive  # fixed hints (--retry-hint fixed) are the base value: no forecast

        def slot_free_at(at: float, need: float, deficit: float, ahead: int) -> float | None:
            # Short of `deficit` slots: 1 - deficit of them are free now (and held for appointments);
            # the first `ahead` appointments' requests free theirs again after their service.
            service_s = hints.service_time_s
            promised = NOTHING_PROMISED
            if service_s:
                times = slots.times if ahead >= len(slots.times) else slots.times[:ahead]
                promised = (times, service_s + registry.round_delay_s)
            return forecast.slot_free_at(at, math.ceil(need), service_s, max(0, 1 - int(deficit)), promised)

        slots = AppointmentBook(YieldReason.INFLIGHT.value, registry, True, slot_free_at)
        self.inflight = InflightLimiter(max_inflight, hints, slots if booking else None)
        self.rate = RateLimit(qps, burst, now)

        def tokens_free_at(at: float, need: float, deficit: float, ahead: int) -> float | None:
            service_s = hints.service_time_s
            if not service_s:
                return forecast.tokens_free_at(at, need, service_s)
            times, cumulative = tokens.times, tokens.cumulative()
            if ahead < len(times):
                times, cumulative = times[:ahead], cumulative[:ahead]
            promised = (times, service_s + registry.round_delay_s)
            return forecast.tokens_free_at(at, need, service_s, promised, cumulative, registry.round_delay_s)

        tokens = AppointmentBook(YieldReason.TOKENS.value, registry, False, tokens_free_at)
        self.tokens = TokenBudget(max_inflight_tokens, hints, tokens if booking else None)
        self.token_rate = TokenRate(tokens_per_s, tokens_burst, now)
        self.pool = Pool(endpoints, max_inflight, hints, forecast)
        self.deadline = DeadlineLimit(self.pool, forecast, hints)
        self.adaptive = AdaptiveLimit(adaptive or AdaptivePolicy(ceiling=max_inflight))
        self.tenants = Tenants(hints, now)
        self.tenant_caps = TenantCaps(forecast, hints)
        self.fair = FairShare(self.tenants, DEFAULT_SHARE_THRESHOLD, self.inflight, self.tokens, hints)
        self.ceilings = PriorityCeilings(CeilingPolicy())
        self.fleet: SharedLimit | None = None  # this replica's share of the fleet caps, with --fleet
        self._sharing = False  # whether fair shares apply: only between several tenants
        self._every: tuple[Limit, ...] = (
            self.drain,
            self.tenant_caps,
            self.inflight,
            self.rate,
            self.tokens,
            self.token_rate,
            self.fair,
            self.pool,
            self.deadline,
            forecast,
        )
        self._limits: tuple[Limit, ...] = ()
        self._checks: tuple[Callable[[float, Ask], Refusal | None], ...] = ()
        self._fits: tuple[Callable[[Ask], None], ...] = ()
        self._activate()

    def _activate(self) -> None:
        """The limits that can refuse now, in order: draining only while draining, the rate and
        token caps only when there are, tenant caps when a tenant has one, fair shares between
        several tenants. Every frame runs their checks, so none is there for nothing. The
        in-flight tokens, globally and per tenant, are charged either way (they are exported as
        gauges); the fair share is charged after the global caps (it reads what they hold)."""
        checked: list[Limit] = [self.drain] if self.drain.draining else []
        tenant_caps = self.tenants.any_caps
        if tenant_caps:
            checked.append(self.tenant_caps)
        checked.append(self.inflight)
        if self.rate.bucket is not None:
            checked.append(self.rate)
        if self.tokens.max_tokens:
            checked.append(self.tokens)
        if self.token_rate.bucket is not None:
            checked.append(self.token_rate)
        fleet = self.fleet
        if fleet is not None:
            checked.append(fleet)
        self._sharing = len(self.tenants) > 1
        if self._sharing:
            checked.append(self.fair)
        checked += (self.pool, self.deadline)
        charged = [limit for limit in (self.tenant_caps, self.tokens) if limit not in checked] + checked
        self._limits = (*charged, self.forecast)
        self._checks = tuple(limit.check for limit in checked)
        self._fits = tuple(budget.fits for budget in (self.tokens, self.token_rate) if budget in checked)
        if tenant_caps:
            self._fits += (self.tenant_caps.fits,)
        if fleet is not None and fleet.caps_tokens:
            self._fits += (fleet.fits,)
        if self.adaptive.enforced:
            self.inflight.set_max(self.adaptive.limit)

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def start_draining(self) -> None:
        """From now on every frame yields with reason `draining`."""
        self.drain.draining = True
        self._activate()

    def set_caps(
        self,
        max_inflight: int,
        qps: float,
        burst: float,
        now: float,
        max_inflight_tokens: int = 0,
        tokens_per_s: float = 0.0,
        tokens_burst: float = 0.0,
    ) -> None:
        """Live change (SIGHUP). Lowering a cap never cancels a running request: it stops new
        admissions until in-flight falls under it."""
        self.max_inflight = max_inflight
        self.inflight.set_max(max_inflight)
        self.rate.set_rate(qps, burst, now)
        self.tokens.max_tokens = max_inflight_tokens
        self.token_rate.set_rate(tokens_per_s, tokens_burst, now)
        self.pool.default_capacity = max_inflight
        self.adaptive.set_ceiling(max_inflight)
        self._activate()

    def join_fleet(self, fleet: SharedLimit) -> None:
        """Enforce this replica's share of the fleet caps (fleet/lease.py) from now on (at start,
        before any frame)."""
        self.fleet = fleet
        self._every = (*self._every, fleet)
        self._activate()

    def fleet_caps_changed(self) -> None:
        """The fleet lease's caps were changed live (SIGHUP): whether its token budget bounds a
        request may have changed with them."""
        self._activate()

    def set_tenancy(
        self,
        tenants: dict[str, TenantLimits],
        implicit: frozenset[str],
        share_threshold: float,
        ceilings: CeilingPolicy,
        now: float,
    ) -> None:
        """The tenant table (those with limits, and the names the token file gives), the
        fair-share threshold and the class ceilings: at start, and live on SIGHUP."""
        self.tenants.configure(tenants, implicit, now)
        self.fair.threshold = share_threshold
        self.ceilings.policy = ceilings
        self._activate()

    def decide(self, now: float, ask: Ask = NO_ASK) -> Grant | Refusal:
        """A refusal is the refusing limit's own object (limits.Refusal): read it at once.
        Raises `OverBudget` for a request larger than a whole token budget."""
        if ask is NO_ASK:
            ask = Ask()  # this decision sets its ceiling: never on the shared default
        ask.ceiling = self.ceilings.ceiling(ask.priority, now)
        appointments = self.appointments
        if appointments.by_ticket or appointments.lapsed:
            ask.appointment = appointments.find(ask.ticket, ask.identity, ask.identity_unique, ask.tenant, now)
        for fits in self._fits:
            fits(ask)
        for check in self._checks:
            refusal = check(now, ask)
            if refusal is not None:
                if self._sharing:
                    self.fair.refused(ask.tenant, now, refusal)
                return refusal
        grant = Grant(ask)
        for limit in self._limits:
            limit.charge(grant, now)
        return grant

    def started(self, grant: Grant, ttft_s: float, now: float) -> None:
        """The request's first token came `ttft_s` after its admission: it waits no more on its
        endpoint, whose TTFT model learns the sample, as does the adaptive limit."""
        self._learn_ttft(grant, ttft_s)
        self.pool.started(grant)
        self.forecast.started(grant, now)
        adaptive = self.adaptive
        if adaptive.policy.mode is AdaptiveMode.OFF:
            return
        limit = adaptive.observe(grant.concurrency, ttft_s, now)
        if adaptive.enforced and limit != self.inflight.max_inflight:
            self.inflight.set_max(limit)

    def refund(self, grant: Grant) -> None:
        """The admitted frame will not run: give back what `charge` took (its slots go with `release`).
        Every limit is asked, active or not: one may have been switched off since the charge."""
        for limit in self._every:
            limit.refund(grant)

    def release(self, grant: Grant, executed: bool, now: float | None = None) -> None:
        """Free what the ended request held; with the time it ended (`now`), the release forecast
        learns from its stream and scores the forecast it made of it."""
        for limit in self._every:
            limit.release(grant, executed)
        if now is not None:
            self.forecast.ended(grant, executed, now)

    def expired(self, grant: Grant, waited_s: float) -> None:
        """The request's deadline passed after `waited_s` without a first token: its TTFT is at
        least that. The model learns it as a sample, or it would learn only from the requests fast
        enough to be answered and predict too low exactly when deadlines are being missed."""
        self._learn_ttft(grant, waited_s)

    @staticmethod
    def _learn_ttft(grant: Grant, seconds: float) -> None:
        """Its endpoint's TTFT model learns `seconds` for the load it was routed under (once: not
        after its first token)."""
        endpoint = grant.endpoint
        if endpoint is not None and not grant.started:
            endpoint.ttft.observe(grant.tokens_ahead, grant.requests_ahead, seconds)

    def reroute(self, grant: Grant, now: float) -> bool:
        """Route a request whose endpoint was lost before it started to another endpoint: the old
        endpoint's slot is freed (as failed) and the new one charged; the global limits keep what
        they charged. False, changing nothing, when no other endpoint can take it now."""
        pool = self.pool
        try:
            if self.drain.draining or pool.check(now, grant.ask) is not None:
                return False
        except OverBudget:  # no endpoint left up has a token budget it fits in
            return False
        old = Grant(grant.ask)
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
