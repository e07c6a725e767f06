"""Weighted fair shares between tenants near saturation, decided at once: who yields first.

Virtual token counters, as in VTC (Sheng et al., OSDI'24), adapted to a governor that yields
instead of queueing. Each tenant's counter (`Tenant.service`) grows by the token cost of what it
is admitted, divided by its weight, and is corrected with the real cost when the request settles.
A tenant is *contending* while it has unmet demand or takes contended capacity: for
`CONTENDING_S` after any of its frames was refused, or admitted past the threshold.

- **Below the threshold** (`--tenant-share-from`, a fraction of the global caps after this
  admission) nobody yields for its share: while there is room, anyone gets in.
- **Past it**, a frame is admitted only if its tenant's counter is the lowest among the
  contending tenants; any other yields `tenant_share`. So contended capacity goes to whoever has
  been served least for its weight, and a tenant below its share is admitted while any capacity
  is left. The one refused is told its turn (`_turn_at`: when the others' counters will have
  caught up with its own and with what its earlier turns add) in its tenant's share book
  (appointments.py); back in its window it passes the share, so its turns come at its weighted
  share of the contended capacity and its hint binds.
- **Joining**: a tenant that starts contending has its counter lifted to the lowest contending
  one (VTC's lift), so capacity it did not ask for while others were contending is not owed to it.

The bound (docs/operations.md; measured in benchmarks/admission/tenants.py): while two tenants contend and
every admission is past the threshold, each admission goes to a tenant with the lowest counter,
so their counters never differ by more than the largest weighted cost of one request, plus what
one settlement gives back: |service_i - service_j| <= 2 * C_max / w_min. Over any such window the
weighted token cost admitted to each differs by at most twice that: VTC's 2x bound with our C.
Below the threshold the faster tenant may pull ahead; the next contended capacity then goes to
the other until the counters meet again.
"""

from __future__ import annotations

import math

from governor.admission.appointments.books import AppointmentBook
from governor.admission.appointments.registry import Appointments
from governor.admission.cost import Ask
from governor.admission.hints import RetryHintEstimator
from governor.admission.limits import Grant, InflightLimiter, Refusal, TokenBudget
from governor.admission.tenant import Tenant, Tenants
from govwire.vocab import YieldReason

DEFAULT_SHARE_THRESHOLD = 0.8
"""`--tenant-share-from`: the fraction of the global caps past which shares apply."""

_INFLIGHT = YieldReason.INFLIGHT.value

CONTENDING_S = 2.0
"""How long a tenant counts as contending after a refusal or a contended admission: longer than a
retry hint usually is, so a backlogged tenant waiting out its hint keeps its place."""


class FairShare:
    """The `tenant_share` limit (limits.Limit). Active only with more than one tenant."""

    __slots__ = ("tenants", "threshold", "_inflight", "_tokens", "_hints", "_refusal", "_registry")

    def __init__(
        self,
        tenants: Tenants,
        threshold: float,
        inflight: InflightLimiter,
        tokens: TokenBudget,
        hints: RetryHintEstimator,
        registry: Appointments | None = None,
    ) -> None:
        self.tenants = tenants
        self.threshold = threshold  # the fraction of the global caps past which shares apply
        self._inflight = inflight
        self._tokens = tokens
        self._hints = hints
        self._refusal = Refusal(YieldReason.TENANT_SHARE)
        self._registry = registry  # where each tenant's share appointments are kept; None: none (fixed hints)

    def usage(self, requests: int, tokens: int) -> float:
        """The fullest global cap as a fraction, were `requests` and `tokens` more admitted."""
        inflight = self._inflight
        used = (inflight.inflight + requests) / inflight.max_inflight
        budget = self._tokens
        if budget.max_tokens:
            used = max(used, (budget.held + tokens) / budget.max_tokens)
        return used

    def floor(self, now: float) -> tuple[float, float, float]:
        """The lowest and highest counters among the contending tenants (inf and -inf when none
        contends) and their total weight."""
        lowest, highest, weight = math.inf, -math.inf, 0.0
        for tenant in self.tenants:
            if tenant.contending_until > now:
                weight += tenant.limits.weight
                service = tenant.service
                if service < lowest:
                    lowest = service
                if service > highest:
                    highest = service
        return lowest, highest, weight

    def check(self, now: float, ask: Ask) -> Refusal | None:
        tenant = ask.tenant
        if tenant is None:
            return None
        lowest, _, weight = self.floor(now)
        if tenant.contending_until <= now:
            self._join(tenant, lowest)
        if tenant.service <= lowest or self.usage(1, ask.cost) <= self.threshold:
            return None
        if tenant.inflight < tenant.limits.guaranteed_inflight:
            return None  # within its guarantee: not held to its share
        book = tenant.share_book
        if book is not None and book.entries:
            own = book.own(ask.appointment)
            if own is not None and own.opened(now):
                # Its turn, as it was told, whatever it costs now: what it costs is added to its
                # counter, which sets its next turns.
                return None
        refusal = self._refusal
        gap = tenant.service - lowest
        registry = self._registry
        if registry is None:  # --retry-hint fixed: nothing kept
            refusal.appointment = None
            return refusal.at(self._hint_ms(now, gap, weight))
        if book is None:
            book = tenant.share_book = AppointmentBook(YieldReason.TENANT_SHARE.value, registry, False, self._turn_at)
        refusal.hint_ms, refusal.appointment = book.refuse(now, ask, gap, ask.cost / tenant.limits.weight)
        return refusal

    def lends(self, now: float, ask: Ask) -> bool:
        """Whether the full in-flight cap lends `ask` a slot past it (limits.InflightLimiter.lend):
        its tenant is at or below the lowest contending counter (under its share: served least for
        its weight, so VTC would admit it first) and the contending tenants over their shares hold
        at least what would then be past the cap (their guaranteed_inflight apart: a guarantee is
        its tenant's whatever the cap, not a flood's to pay back). A quiet tenant's arrival is thus not refused to
        wait for a flood's next release (nor for the flood's appointments, which rank below it:
        books.AppointmentBook.held): it is admitted at once, and the flood pays the loan back, its
        next admissions refused and its held returns waiting until in-flight is back under the cap
        (within their promise horizon, else refused for good). What is lent stays within what the
        tenants over their shares hold (so in-flight under twice the cap, guarantees and the
        critical allowance apart), and one tenant never holds more than the cap."""
        tenant = ask.tenant
        if tenant is None:
            return False
        lowest, _, weight = self.floor(now)
        if tenant.service > lowest or lowest == math.inf:  # over its share, or nobody contends
            return False
        inflight = self._inflight
        if tenant.inflight >= inflight.max_inflight:
            return False
        held = 0  # what the tenants over their shares hold, but for their guarantees (theirs whatever the cap)
        for other in self.tenants:
            if other is not tenant and other.contending_until > now and other.service > lowest:
                held += max(0, other.inflight - other.limits.guaranteed_inflight)
        return inflight.inflight + 1 - inflight.max_inflight <= held

    def _turn_at(self, at: float, need: float, deficit: float, ahead: int) -> float | None:
        """A share book's `FreeAt`: when the other contending tenants' counters will have caught up
        by `need` (how far the tenant's is past the lowest, and what its appointments before this
        one will add to it), contended capacity serving their total weight at the rate the held
        tokens drain (Little's law). None while nothing is known of that rate."""
        hints = self._hints
        held = self._tokens.held
        service_s = hints.service_time_s
        if not service_s or held <= 0:
            return None
        _, _, weight = self.floor(at)
        return at + need * weight * service_s / held

    def admits_without(self, now: float, ask: Ask, victim: Grant) -> bool:
        """Whether `check` would pass `ask` once `victim` (dispatched, no token streamed) has given
        back its slot and its cost, and its tenant's counter what it did not use (its prompt, as
        the lifecycle settles it); read without touching any counter."""
        tenant = ask.tenant
        if tenant is None or self.usage(0, ask.cost - victim.ask.cost) <= self.threshold:
            return True
        owner = victim.ask.tenant
        unused = victim.ask.cost - victim.ask.prompt_tokens
        lowest = math.inf
        for other in self.tenants:
            if other.contending_until > now:
                service = other.service - (unused / other.limits.weight if other is owner else 0.0)
                if service < lowest:
                    lowest = service
        service = tenant.service - (unused / tenant.limits.weight if tenant is owner else 0.0)
        return service <= lowest  # (a tenant joining is lifted only up to the lowest: the same test)

    def _hint_ms(self, now: float, gap: float, weight: float) -> int:
        """How long until the others' counters catch up by `gap`: contended capacity serves the
        contending tenants' total weight at the rate the held tokens drain (Little's law). The
        estimator's hint before anything is known, and with `--retry-hint fixed` (the base value)."""
        hints = self._hints
        held = self._tokens.held
        if not hints.policy.adaptive or not hints.service_time_s or held <= 0:  # fixed, or nothing known yet
            return hints.hint_ms(now)
        rate = held / hints.service_time_s  # token cost served per second
        return hints.jittered_ms(min(hints.policy.max_ms, 1000.0 * gap * weight / rate))

    @staticmethod
    def _join(tenant: Tenant, lowest: float) -> None:
        """A tenant starts contending: nothing is owed to it for the time it did not (VTC's lift)."""
        if tenant.service < lowest < math.inf:
            tenant.service = lowest

    def refused(self, tenant: Tenant | None, now: float, refusal: Refusal) -> None:
        """A frame of `tenant` was refused by some limit: it has unmet demand, so it contends.
        Refused by the global concurrency cap, its hint is booked on its own timeline at its
        weighted share of the slot releases (`S / (max_inflight x share)` apart), not behind
        every client of the other tenants the cap refused before: slots past the threshold go
        by share, so a light tenant's next one does not wait for a heavy tenant's crowd. A
        refusal that booked an appointment keeps its hint: the time told is the time kept; so
        does a final one (past the promise horizon)."""
        if tenant is None:
            return
        lowest, _, weight = self.floor(now)
        if tenant.contending_until <= now:
            self._join(tenant, lowest)
            weight += tenant.limits.weight
        tenant.contending_until = now + CONTENDING_S
        if (
            refusal.reason == _INFLIGHT
            and refusal.appointment is None
            and not refusal.final
            and self._hints.service_time_s
        ):
            slots = self._inflight.max_inflight * tenant.limits.weight / weight
            refusal.hint_ms = tenant.request_drain.hint_ms(now, 1, 1, slots)

    def charge(self, grant: Grant, now: float) -> None:
        tenant = grant.ask.tenant
        if tenant is None:
            return
        book = tenant.share_book
        if book is not None and book.entries:
            book.redeem(grant.ask.appointment, now)
        tenant.service += grant.ask.cost / tenant.limits.weight
        if self.usage(0, 0) > self.threshold:  # it took contended capacity (charged already)
            tenant.contending_until = now + CONTENDING_S

    def refund(self, grant: Grant) -> None:
        return None  # settled by `release` (a request that never ran used 0)

    def release(self, grant: Grant, executed: bool) -> None:
        tenant = grant.ask.tenant
        if tenant is not None:
            tenant.service += (grant.used - grant.ask.cost) / tenant.limits.weight
