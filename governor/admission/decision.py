"""The admission decision: one object owns every limit and answers each generate frame at once.

`decide(now, ask)` checks every limit and then charges every limit (limits.py), so a frame is
either admitted with a `Grant` (its endpoint) or refused with a `Refusal` (reason and retry hint)
and no trace on any limit but its appointment (which a rate cap pays for at once). The `Ask` is
what the frame costs in tokens, its deadline (cost.py), its tenant (tenant.py) and its priority
class, whose ceiling (priority.py) sets the fraction of each cap it may fill; a request that no
budget could ever hold raises `OverBudget` before any check. The order of the limits is the order
of the reasons a client sees when several would refuse: draining first, then the tenant's own caps,
then the global concurrency, rate and token caps, then the tenant's fair share (fair_share.py),
then the endpoint pool (which also routes), then the deadline (which predicts on the endpoint the
pool chose). A refused tenant counts as contending for capacity, whichever limit refused it. A
frame of a higher class refused shared capacity closes the gates of the classes below it for a
while (priority.py); one refused by the full in-flight cap may first displace a lower-class request
that has not started (displacement.py), when that slot is all it lacks. `refund` undoes a grant
whose frame turned out invalid, `release` frees what a running request held once it has ended and
settles its token cost (the release forecast and the adaptive limit learn from its stream),
`started` records its first token (the TTFT model learns from it), and `reroute` moves a request
whose endpoint was lost to another one without charging the global limits again.

Every admitted request is followed by the release forecast (release_forecast.py) until its end;
the in-flight cap, the token budget, the endpoint caps and each tenant's own in-flight and token
caps hint from it and keep appointments for the clients they refuse (appointments.py); the rate
caps keep theirs by paying for them at once, and a tenant past its fair share is told its turn. A
frame that comes back for its appointment is recognised here, before any limit is checked, and the limits holding
the appointment let it in.

The doors only parse, call `decide` and render the answer; new limits are added here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from governor.admission.adaptive_limit import AdaptiveMode, AdaptivePolicy
from governor.admission.appointments.appointment import Appointment
from governor.admission.appointments.books import HOLD, PrepaidBook
from governor.admission.appointments.registry import identity_of
from governor.admission.build import build_parts, fleet_book
from governor.admission.caps import Caps
from governor.admission.cost import NO_ASK, Ask
from governor.admission.displacement import Displace
from governor.admission.endpoint import Endpoint
from governor.admission.hints import RetryHintEstimator
from governor.admission.limits import Grant, Limit, Refusal, SharedLimit
from governor.admission.priority import RANK, CeilingPolicy
from governor.admission.reasons import GATING
from governor.admission.tenant import Tenant, TenantLimits
from govwire.errors import OverBudget
from govwire.vocab import YieldReason

_INFLIGHT = YieldReason.INFLIGHT.value
_DRAINING = YieldReason.DRAINING.value
_CLASS_RANK = {priority: 2 * rank + 1 for priority, rank in RANK.items()}
"""`Ask.rank` of a frame of each class whose tenant is not over its share (cost.RANKS)."""


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
        "displacement",
        "horizon_ms",
        "shed_blind_retries",
        "_first_refused_until",
        "_learning",
        "_area",
        "_area_at",
        "_sharing",
        "_lowest",
        "_over",
        "_classes",
        "_every",
        "_rooms",
        "_limits",
        "_checks",
        "_fits",
    )

    def __init__(
        self,
        endpoints: list[Endpoint],
        caps: Caps,
        hints: RetryHintEstimator,
        now: float,
        adaptive: AdaptivePolicy | None = None,
        appointment_grace_s: float = 0.05,
        served: bool = False,
    ) -> None:
        """Admission under `caps` over `endpoints` (its parts: build.py). `served`: its decisions
        are carried out by a server's lifecycle and lobby (state.ServerState): a client back for
        its appointment before its capacity frees is held (HOLD), not told a new time, and a
        higher class may displace a request not started (Displace). Alone (as in its own tests),
        neither happens."""
        parts = build_parts(endpoints, caps, hints, now, adaptive, appointment_grace_s, served)
        self.hints = hints
        # Refusals whose hint is at least this far are final (Refusal.final): no promise is booked
        # past it (RetryHintPolicy.horizon_ms), so none of them carries an appointment.
        self.horizon_ms = hints.policy.horizon_ms
        self.max_inflight = caps.max_inflight  # as configured; the effective cap may be the adaptive one
        self.forecast = parts.forecast
        self.appointments = parts.appointments
        self.drain = parts.drain
        self.inflight = parts.inflight
        self.rate = parts.rate
        self.tokens = parts.tokens
        self.token_rate = parts.token_rate
        self.pool = parts.pool
        self.deadline = parts.deadline
        self.adaptive = parts.adaptive
        self.tenants = parts.tenants
        self.tenant_caps = parts.tenant_caps
        self.fair = parts.fair
        self.ceilings = parts.ceilings
        self.displacement = parts.displacement
        self._learning = self.adaptive.policy.mode is not AdaptiveMode.OFF
        self.ceilings.on_classes = self._activate  # the first frame of another class than standard
        # --shed-blind-retries: a retry without a valid appointment may fill only the sheddable
        # ceiling of each cap while a first attempt was refused capacity lately (until then).
        self.shed_blind_retries = False
        self._first_refused_until = -math.inf
        # --adaptive-limit: in-flight integrated over time (request x seconds) up to `_area_at`, so
        # that a stream's mean batch is the area it spans over its duration (`_learn_step`).
        self._area = 0.0
        self._area_at = now
        self.fleet: SharedLimit | None = None  # this replica's share of the fleet caps, with --fleet
        self._sharing = False  # whether fair shares apply: only between several tenants
        self._lowest = math.inf  # the lowest contending counter, as of the last frame (`_rank_of`)
        self._over: tuple[bool, ...] = ()  # which tenants were over their share then
        self._classes = False  # whether frames of several classes came: the gates and displacement apply
        self._every = parts.every()  # every limit, active or not: refunds and releases reach all
        self._rooms = parts.rooms()  # the limits that report their room (headroom)
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
        self.appointments.standing = self._standing if self._sharing else None
        self.appointments.standings += 1
        if self._sharing:
            checked.append(self.fair)
        self.inflight.lend = self.fair.lends if self._sharing else None
        checked += (self.pool, self.deadline)
        charged = [limit for limit in (self.tenant_caps, self.tokens) if limit not in checked] + checked
        self._classes = self.ceilings.classes_seen
        displacing = self._classes and self.displacement.armed
        self._limits = (*charged, self.forecast, self.displacement) if displacing else (*charged, self.forecast)
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

    def set_caps(self, caps: Caps, now: float) -> None:
        """Live change (SIGHUP). Lowering a cap never cancels a running request: it stops new
        admissions until in-flight falls under it."""
        self.max_inflight = caps.max_inflight
        self.inflight.set_max(caps.max_inflight)
        self.rate.set_rate(caps.max_qps, caps.qps_burst, now)
        self.tokens.max_tokens = caps.max_inflight_tokens
        self.token_rate.set_rate(caps.max_tokens_per_s, caps.tokens_burst, now)
        self.pool.default_capacity = caps.max_inflight
        self.adaptive.set_ceiling(caps.max_inflight)
        self._activate()

    def join_fleet(self, fleet: SharedLimit, promises: bool = False) -> None:
        """Enforce this replica's share of the fleet caps (fleet/lease.py) from now on (at start,
        before any frame); with `promises` (`--fleet-promises on`), its in-flight share books the
        clients it refuses, unless hints are fixed."""
        self.fleet = fleet
        if promises and self.hints.policy.adaptive:
            fleet.keep(fleet_book(self.forecast, self.hints, self.appointments, fleet.growth))
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
        preempt: bool = True,
        tenant_loan: int = 0,
    ) -> None:
        """The tenant table (those with limits, and the names the token file gives), the
        fair-share threshold, the class ceilings and whether higher classes displace requests
        not started (`--preempt`): at start, and live on SIGHUP."""
        self.tenants.configure(tenants, implicit, now)
        self.inflight.guaranteed = self.tenants.guaranteed_inflight
        self.fair.threshold = share_threshold
        self.ceilings.policy = ceilings
        self.inflight.allowance = ceilings.critical_allowance
        self.inflight.loan = tenant_loan
        self.displacement.enabled = preempt
        self._activate()

    def decide(self, now: float, ask: Ask = NO_ASK) -> Grant | Refusal | Displace:
        """A refusal is the refusing limit's own object (limits.Refusal): read it at once. A
        `Displace` (only when served, displacement.py) is for the lifecycle to carry out. Raises
        `OverBudget` for a request larger than a whole token budget."""
        if ask is NO_ASK:
            ask = Ask()  # this decision sets its ceiling: never on the shared default
        ask.ceiling = self.ceilings.ceiling(ask.priority, now)
        if self._sharing:
            ask.rank = self._rank_of(now, ask)
        elif self._classes:
            ask.rank = _CLASS_RANK[ask.priority]
        appointments = self.appointments
        if ask.appointment is None and (appointments.by_ticket or appointments.lapsed):  # someone may be back
            if ask.resent is not None and not ask.identity:
                ask.identity = identity_of(ask.tenant, ask.resent)
            ask.appointment = appointments.find(ask.ticket, ask.identity, ask.identity_unique, ask.tenant, now)
        # Shed before first attempts: a blind retry held to the sheddable ceiling, and then refused,
        # was refused by that cap and no shortage of its class: it closes no class gate, displaces
        # nobody and does not contend for a fair share.
        shed = self.shed_blind_retries and ask.retry and ask.appointment is None and self._first_refused_until > now
        if shed:
            ask.ceiling = min(ask.ceiling, self.ceilings.policy.sheddable)
        for fits in self._fits:
            fits(ask)
        for check in self._checks:
            refusal = check(now, ask)
            if refusal is not None:
                if refusal.hint_ms == HOLD:
                    return refusal  # not an answer yet: its holder waits in the lobby
                refusal.final = self.is_final(refusal.reason, refusal.hint_ms)
                if self._classes and not shed:
                    if refusal.reason == _INFLIGHT and self.displacement.armed:
                        displace = self._displace(now, ask, refusal)
                        if displace is not None:
                            return displace
                    self._gate(now, ask, refusal)
                if self._sharing and not shed:
                    self.fair.refused(ask.tenant, now, refusal)
                if self.shed_blind_retries and not ask.retry and ask.appointment is None and refusal.reason in GATING:
                    hold = max(self.hints.gap_s, self.ceilings.policy.hold_s)
                    self._first_refused_until = max(self._first_refused_until, now + hold)
                held = ask.appointment
                if held is not None and refusal.appointment is not held:
                    self._refused_elsewhere(held, now)
                booked = refusal.appointment
                if booked is not None and not booked.identity:
                    self._name(booked, ask)
                return refusal
        grant = Grant(ask)
        if self._learning:
            self._tick(now)
        for limit in self._limits:
            limit.charge(grant, now)
        return grant

    def _name(self, appointment: Appointment, ask: Ask) -> None:
        """Booked before anyone was coming back (no identity yet): its return is recognised by
        what its client re-sends (the OpenAI SDKs re-send the same body after `retry-after-ms`)."""
        if not appointment.identity and ask.resent is not None:
            self.appointments.identify(appointment, identity_of(ask.tenant, ask.resent))

    def headroom(self, grant: Grant, now: float) -> int:
        """How many more requests like the one `grant` admitted the limit that binds first would
        admit now, after it (llm-d's `x-llm-d-flow-band-headroom-requests`: a count, shared, nothing
        kept for the reader): the least room any limit reports (`room`), each counting as its check
        would for the request's class. Read after the grant was charged; only for the front door's
        answers."""
        rooms = [limit.room(grant, now) for limit in self._rooms]
        if self.fleet is not None:
            rooms.append(self.fleet.room(grant, now))
        return max(0, int(min(rooms)))

    def _refused_elsewhere(self, held: Appointment, now: float) -> None:
        """A frame back for `held` in its window was refused by another limit (one checked before
        or after the one that booked it: a tenant's share, a rate, the deadline): its appointment
        goes back (counted `refused_elsewhere`) rather than keeping capacity idle until its window
        closes and lapsing against its book's trust. (A limit that booked the frame anew removed
        and counted it already; a frame back before its window keeps its place.)"""
        if held.live and held.opened(now):
            held.book.refused_elsewhere(held)

    def _rank_of(self, now: float, ask: Ask) -> int:
        """Where the frame stands among the appointments (`Ask.rank`): its class, then whether its
        tenant is at or below its fair share. A tenant below its share that meets the full cap
        thus takes the next release (its appointment goes before those of tenants over their
        share, and theirs do not keep it out), not the one after every client of theirs."""
        tenant = ask.tenant
        if tenant is None:
            return _CLASS_RANK[ask.priority]
        lowest, _, _ = self.fair.floor(now)
        self._lowest = lowest
        over = tuple(t.service > lowest for t in self.tenants)
        if over != self._over:  # the books re-rank their appointments when next consulted
            self._over = over
            self.appointments.standings += 1
        return _CLASS_RANK[ask.priority] - (tenant.service > lowest)

    def _standing(self, appointment: Appointment) -> int:
        """An appointment's rank now (Appointments.standing): its class, as booked, then whether its
        tenant is over its fair share as of this frame (`_rank_of`), as a new frame's would be."""
        tenant = appointment.tenant
        rank = appointment.rank | 1  # (its class's rank at its share)
        return rank if not isinstance(tenant, Tenant) else rank - (tenant.service > self._lowest)

    def _gate(self, now: float, ask: Ask, refusal: Refusal) -> None:
        """A frame was refused capacity: the ceilings of the classes below its own apply for
        `--priority-hold-s`, or until its appointment's window closes (priority.py)."""
        if refusal.reason in GATING:
            appointment = refusal.appointment
            # (a rate cap's appointment paid for its tokens already: no gate need keep them)
            kept = appointment is not None and not isinstance(appointment.book, PrepaidBook)
            due = appointment.closes if kept and appointment is not None else -math.inf
            self.ceilings.refused(ask.priority, now, self.hints.gap_s, due)

    def _displace(self, now: float, ask: Ask, refusal: Refusal) -> Displace | None:
        """The frame `ask` was refused by the full in-flight cap: displace a request of a lower
        class that has not started (displacement.py) when that is all it takes to admit it, its
        refusal undone. None when there is no victim or another limit would still refuse it."""
        displacement = self.displacement
        victim = displacement.victim(now, ask)
        if victim is None or not self._room_without(now, ask, victim):
            return None
        booked = refusal.appointment
        if booked is not None and booked is not ask.appointment:  # booked by the refusal being undone
            booked.book.remove(booked)
        refusal.appointment = None
        displacement.displaced(victim, now, self.hints.gap_s, ask.priority)
        return Displace(victim)

    def after_displacing(
        self, now: float, ask: Ask, displace: Displace
    ) -> tuple[Grant | Refusal, int, Appointment | None]:
        """The victim was settled (so in-flight never exceeds the cap): the frame decided again on
        what it freed, then the victim's hint and appointment, booked against the full cap for
        its client to be told."""
        decision: Grant | Refusal | None = None
        for check in self._checks:
            decision = check(now, ask)
            if decision is not None:
                decision.final = self.is_final(decision.reason, decision.hint_ms)
                if decision.appointment is not None:
                    self._name(decision.appointment, ask)
                break
        if decision is None:
            decision = Grant(ask)
            if self._learning:
                self._tick(now)
            for limit in self._limits:
                limit.charge(decision, now)
        return (decision, *self._rebook(now, displace.victim))

    def is_final(self, reason: str, hint_ms: int) -> bool:
        """Whether a yield tells its client not to come back: its capacity is at least the promise
        horizon away (a drain is never final: another replica may take the client at once). The
        one rule, for the refusals here and the yields after admission (the lifecycle's)."""
        return hint_ms >= self.horizon_ms and reason != _DRAINING

    def _room_without(self, now: float, ask: Ask, victim: Grant) -> bool:
        """Whether, once `victim` has given back what it holds, the limits after the in-flight
        cap would let `ask` in too (their checks read without running them: a check that refuses
        books hints). Not across a fleet: its lease is not freed by a local victim."""
        inflight = self.inflight
        book = inflight.book
        held = book.held(now, ask.appointment, ask.rank) if book is not None and book.entries else 0.0
        if inflight.inflight + held > inflight.max_inflight * ask.ceiling or self.fleet is not None:
            return False
        cost, freed = ask.cost, victim.ask.cost
        tokens = self.tokens
        if tokens.max_tokens and tokens.held - freed + cost > tokens.max_tokens * ask.ceiling:
            return False
        for bucket, take in ((self.rate.bucket, 1.0), (self.token_rate.bucket, float(cost))):
            if bucket is not None and bucket.level(now) - take < (1.0 - ask.ceiling) * bucket.burst:
                return False
        if self._sharing and not self.fair.admits_without(now, ask, victim):
            return False
        endpoint = victim.endpoint
        if endpoint is None:
            return True
        budget = endpoint.limits.tokens
        return (
            endpoint.up
            and endpoint.paused_until <= now
            and not (budget and endpoint.tokens - freed + cost > budget)
            and (endpoint.bucket is None or endpoint.bucket.level(now) >= 1.0)
        )

    def _rebook(self, now: float, victim: Grant) -> tuple[int, Appointment | None]:
        """The displaced request's hint and appointment: as for a frame the full cap refuses now.
        Its appointment is marked: when it comes back it is never displaced again."""
        inflight = self.inflight
        book = inflight.book
        if book is None:
            return self.hints.hint_ms(now), None
        ask = victim.ask
        deficit = max(1, inflight.inflight + 1 - int(inflight.max_inflight * ask.ceiling))
        hint_ms, appointment = book.refuse(now, ask, deficit, 1.0, displaced=True)
        if appointment is not None:
            self._name(appointment, ask)
        return hint_ms, appointment

    def started(self, grant: Grant, ttft_s: float, now: float) -> None:
        """The request's first token came `ttft_s` after its admission: it waits no more on its
        endpoint, whose TTFT model learns the sample."""
        self._learn_ttft(grant, ttft_s)
        self.pool.started(grant)
        self.forecast.started(grant, now)
        if self._classes:
            self.displacement.started(grant)
        if self._learning:
            self._tick(now)
            grant.inflight_area = self._area

    def refund(self, grant: Grant) -> None:
        """The admitted frame will not run: give back what `charge` took (its slots go with `release`).
        Every limit is asked, active or not: one may have been switched off since the charge."""
        for limit in self._every:
            limit.refund(grant)

    def release(self, grant: Grant, executed: bool, now: float | None = None) -> None:
        """Free what the ended request held; with the time it ended (`now`), the release forecast
        learns from its stream and scores the forecast it made of it, and the adaptive limit
        learns the engine's step at the batch the stream ran in."""
        if now is not None and self._learning:
            self._tick(now)
            self._learn_step(grant, now)
        for limit in self._every:
            limit.release(grant, executed)
        if now is not None:
            self.forecast.ended(grant, executed, now)

    def _tick(self, now: float) -> None:
        """Integrate in-flight up to `now`, before it changes (--adaptive-limit)."""
        if now > self._area_at:
            self._area += self.inflight.inflight * (now - self._area_at)
            self._area_at = now

    def _learn_step(self, grant: Grant, now: float) -> None:
        """A stream of at least three tokens ended: its mean gap is a decode step at the batch it
        ran in, the requests in flight on average from its first token to its end (itself
        included). Under `--adaptive-limit enforce` the limit it gives is the cap from now on."""
        progress = grant.progress
        if progress is None or progress.t_first_token is None or progress.tokens_seen < 3:
            return
        step_s = (progress.t_last_token - progress.t_first_token) / (progress.tokens_seen - 1)
        spanned = now - progress.t_first_token
        if spanned <= 0:
            return
        batch = (self._area - grant.inflight_area) / spanned
        # What the engines run at once (each worker's --max-running, an endpoint's batch=): past it
        # requests would queue in them, so the limit stays within it. 0 when one of them is unknown.
        batches = [self.forecast.model(endpoint).batch for endpoint in self.pool.endpoints]
        adaptive = self.adaptive
        limit = adaptive.observe(batch, step_s, now, sum(batches) if all(batches) else 0)
        if adaptive.enforced and limit != self.inflight.max_inflight:
            self.inflight.set_max(limit)

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
            endpoint.ttft.observe(grant.ask.prompt_tokens, grant.tokens_ahead, grant.requests_ahead, seconds)

    def reroute(self, grant: Grant, now: float) -> bool:
        """Route a request whose endpoint was lost before it started to another endpoint: the old
        endpoint's slot is freed (as failed) and the new one charged; the global limits keep what
        they charged. False, changing nothing, when no other endpoint can take it now."""
        pool = self.pool
        try:
            if self.drain.draining or not pool.routes(now, grant.ask):
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
