"""Building admission: every limit, the book it keeps its appointments in and what it reasons
with (the release forecast, the hints, the registry), made once at start. `Admission` (decision.py)
takes the parts and decides; nothing here runs per frame but the `FreeAt` closures, which the
books call when they refuse.

The books and their limits refer to each other (a limit refuses through its book; the book's
forecast reads the limit's requests), so each forecast reads what it needs when asked: the book
it belongs to, the endpoints at their caps, one tenant's or one endpoint's requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from governor.admission.adaptive_limit import AdaptiveLimit, AdaptivePolicy
from governor.admission.appointments.books import AppointmentBook, FreeAt, NewBook, PrepaidBook
from governor.admission.appointments.registry import Appointments
from governor.admission.caps import Caps
from governor.admission.deadline import DeadlineLimit
from governor.admission.displacement import Displacement
from governor.admission.endpoint import Endpoint
from governor.admission.fair_share import DEFAULT_SHARE_THRESHOLD, FairShare
from governor.admission.hints import RetryHintEstimator
from governor.admission.limits import Draining, InflightLimiter, Limit, RateLimit, Roomy, TokenBudget, TokenRate
from governor.admission.pool import Pool
from governor.admission.priority import CeilingPolicy, PriorityCeilings
from governor.admission.reasons import BOOKING
from governor.admission.release_forecast import NOTHING_PROMISED, ReleaseForecast
from governor.admission.tenant import Tenants
from governor.admission.tenant_caps import TenantCaps
from govwire.vocab import YieldReason

_INFLIGHT = YieldReason.INFLIGHT.value
_TOKEN_BOOKS = (YieldReason.ENDPOINT_TOKENS.value, YieldReason.TENANT_TOKENS.value)
"""The own caps' books that count token cost (the others count requests)."""


@dataclass(slots=True)
class Parts:
    """Every limit admission checks, and what they share."""

    forecast: ReleaseForecast
    appointments: Appointments
    drain: Draining
    inflight: InflightLimiter
    rate: RateLimit
    tokens: TokenBudget
    token_rate: TokenRate
    pool: Pool
    deadline: DeadlineLimit
    adaptive: AdaptiveLimit
    tenants: Tenants
    tenant_caps: TenantCaps
    fair: FairShare
    ceilings: PriorityCeilings
    displacement: Displacement

    def every(self) -> tuple[Limit, ...]:
        """Every limit, in the order a refund or a release reaches them."""
        return (
            self.drain,
            self.tenant_caps,
            self.inflight,
            self.rate,
            self.tokens,
            self.token_rate,
            self.fair,
            self.pool,
            self.deadline,
            self.forecast,
            self.displacement,
        )

    def rooms(self) -> tuple[Roomy, ...]:
        """The limits that report their room (the global in-flight cap bounds it: always set)."""
        return (self.inflight, self.tokens, self.rate, self.token_rate, self.pool, self.tenant_caps)


def build_parts(
    endpoints: list[Endpoint],
    caps: Caps,
    hints: RetryHintEstimator,
    now: float,
    adaptive: AdaptivePolicy | None,
    grace_s: float,
    served: bool,
) -> Parts:
    """The limits under `caps` over `endpoints`, each with its book unless hints are fixed
    (--retry-hint fixed: the base value, no forecast, nothing booked); `served` (Admission):
    a returning client in its window is held (its books answer HOLD) rather than told a new time,
    and displacement is carried out."""
    forecast = ReleaseForecast()
    registry = Appointments(grace_s, hints, lobby=served)
    registry.stretch = forecast.stretch
    booking = hints.policy.adaptive
    slots = AppointmentBook(_INFLIGHT, registry, True, _slots_free_at(forecast, hints, registry, lambda: slots))
    inflight = InflightLimiter(caps.max_inflight, hints, slots if booking else None, forecast.service_of)
    qps_book = PrepaidBook(YieldReason.QPS.value, registry, True, lambda: rate.bucket)
    rate = RateLimit(caps.max_qps, caps.qps_burst, now, qps_book if booking else None)
    tokens_book = AppointmentBook(
        YieldReason.TOKENS.value, registry, False, _tokens_free_at(forecast, hints, registry, lambda: tokens_book)
    )
    tokens = TokenBudget(caps.max_inflight_tokens, hints, tokens_book if booking else None)
    token_rate_book = PrepaidBook(YieldReason.TOKEN_RATE.value, registry, False, lambda: token_rate.bucket)
    token_rate = TokenRate(caps.max_tokens_per_s, caps.tokens_burst, now, token_rate_book if booking else None)
    # As for the global cap, over the requests of the endpoints at their caps only.
    endpoint_free_at = _slots_free_at(forecast, hints, registry, lambda: endpoint_slots, lambda: pool.capped)
    endpoint_slots = AppointmentBook(YieldReason.ENDPOINT_INFLIGHT.value, registry, True, endpoint_free_at)
    own_book = own_books(forecast, hints, registry) if booking else None
    pool = Pool(
        endpoints,
        caps.max_inflight,
        hints,
        forecast,
        endpoint_slots if booking else None,
        own_book,
        registry if booking else None,
    )
    tenants = Tenants(hints, now)
    if booking:
        registry.reasons = BOOKING
    return Parts(
        forecast=forecast,
        appointments=registry,
        drain=Draining(hints),
        inflight=inflight,
        rate=rate,
        tokens=tokens,
        token_rate=token_rate,
        pool=pool,
        deadline=DeadlineLimit(pool, forecast, hints),
        adaptive=AdaptiveLimit(adaptive or AdaptivePolicy(ceiling=caps.max_inflight)),
        tenants=tenants,
        tenant_caps=TenantCaps(own_book, registry if booking else None),
        fair=FairShare(tenants, DEFAULT_SHARE_THRESHOLD, inflight, tokens, hints, registry if booking else None),
        ceilings=PriorityCeilings(CeilingPolicy()),
        displacement=Displacement(served),
    )


def own_books(forecast: ReleaseForecast, hints: RetryHintEstimator, registry: Appointments) -> NewBook:
    """Makes the book of one tenant's (or one endpoint's) own cap, `reason`: as for the global cap
    or token budget, over the requests of `key` only (books.NewBook)."""

    def own_book(reason: str, key: object) -> AppointmentBook:
        tokens = reason in _TOKEN_BOOKS
        if tokens:
            forecast.cost_groups = True  # (what its forecast reads)
            free_at = _tokens_free_at(forecast, hints, registry, lambda: book, key)
        else:
            free_at = _slots_free_at(forecast, hints, registry, lambda: book, lambda: (key,))
        book = AppointmentBook(reason, registry, not tokens, free_at)
        return book

    return own_book


def fleet_book(
    forecast: ReleaseForecast,
    hints: RetryHintEstimator,
    registry: Appointments,
    growth: Callable[[float], tuple[tuple[int, float], ...]],
) -> AppointmentBook:
    """The book of this replica's share of the fleet's in-flight cap (fleet/lease.py): the first
    slots nobody was promised are those renewals can grow the share by (`growth(at)`: how many,
    and when each comes, in order), the rest this replica's releases, as for the global cap."""
    releases = _slots_free_at(forecast, hints, registry, lambda: book)

    def free_at(at: float, need: float, deficit: float, ahead: int) -> float | None:
        for grow, due in growth(at):
            if need <= grow:
                return due
            need -= grow
        return releases(at, need, deficit, ahead)

    book = AppointmentBook(YieldReason.FLEET_INFLIGHT.value, registry, True, free_at)
    return book


def _slots_free_at(
    forecast: ReleaseForecast,
    hints: RetryHintEstimator,
    registry: Appointments,
    book: Callable[[], AppointmentBook],
    among: Callable[[], Sequence[object]] | None = None,
) -> FreeAt:
    """When a slot-counting book's next slot frees (its `FreeAt`): short of `deficit` slots,
    1 - deficit of them are free now (and held for appointments); the first `ahead` appointments'
    requests free theirs again after their service. `among`: only the requests of these endpoints
    (an endpoint cap's book) or of this tenant (a tenant's `max_inflight`) count, read when
    asked. `book` is read when asked too: the book is built with this function."""

    def free_at(at: float, need: float, deficit: float, ahead: int) -> float | None:
        service_s = hints.service_time_s
        promised = NOTHING_PROMISED
        if service_s:
            times = book().times
            promised = (times if ahead >= len(times) else times[:ahead], service_s + registry.round_delay_s)
        group = None if among is None else among()
        return forecast.slot_free_at(at, math.ceil(need), service_s, max(0, 1 - int(deficit)), promised, group)

    return free_at


def _tokens_free_at(
    forecast: ReleaseForecast,
    hints: RetryHintEstimator,
    registry: Appointments,
    book: Callable[[], AppointmentBook],
    among: object = None,
) -> FreeAt:
    """When a token-counting book's `need` is back (its `FreeAt`): from the requests in flight (of
    `among` only: a tenant's `max_inflight_tokens` or an endpoint's `tokens=N`) and those the
    first `ahead` appointments start."""

    def free_at(at: float, need: float, deficit: float, ahead: int) -> float | None:
        service_s = hints.service_time_s
        if not service_s:
            return forecast.tokens_free_at(at, need, service_s, among=among)
        kept = book()
        times, cumulative = kept.times, kept.cumulative()
        if ahead < len(times):
            times, cumulative = times[:ahead], cumulative[:ahead]
        promised = (times, service_s + registry.round_delay_s)
        return forecast.tokens_free_at(at, need, service_s, promised, cumulative, registry.round_delay_s, among)

    return free_at
