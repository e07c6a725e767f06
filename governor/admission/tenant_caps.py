"""Each tenant's own caps, as one `Limit` (limits.py): `max_inflight`, `max_qps`,
`max_inflight_tokens` and `max_tokens_per_s`, each refusing with its own `tenant_*` reason."""

from __future__ import annotations

import math

from governor.admission.appointments.books import NewBook, PrepaidBook
from governor.admission.appointments.registry import Appointments
from governor.admission.buckets import TokenBucket
from governor.admission.cost import Ask
from governor.admission.limits import Grant, Refusal, bucket_charge, bucket_refusal, bucket_room, cap_room, over_budget
from governor.admission.tenant import Tenant
from govwire.vocab import YieldReason

_TENANT_INFLIGHT, _TENANT_TOKENS = YieldReason.TENANT_INFLIGHT.value, YieldReason.TENANT_TOKENS.value
_TENANT_QPS, _TENANT_TOKEN_RATE = YieldReason.TENANT_QPS.value, YieldReason.TENANT_TOKEN_RATE.value


class TenantCaps:
    """Each tenant's own caps, as one `Limit`: the request's tenant is its `Ask`'s. What a tenant
    holds (requests, token cost) is counted whether it has caps or not: the per-tenant gauges read it.

    Under a priority class ceiling (`Ask.ceiling`) a cap counts as that fraction of itself, as the
    global caps do. Hints: for `max_inflight` and `max_inflight_tokens`, an appointment in the
    tenant's own book for that cap (appointments.py, made on its first refusal there by
    `new_book`): the next forecast release of the tenant's own requests (or of enough of their
    token cost) nobody was promised, kept for the client it was told to, as the global caps keep
    theirs; for the buckets (`max_qps`, `max_tokens_per_s`), the exact time the tokens are there,
    paid for at once in the tenant's prepaid book for that bucket (limits.bucket_refusal). With
    `--retry-hint fixed` (no `new_book`, no `registry`) nothing is kept: the first two hint the
    base value (the tenant's drain estimate), the buckets their exact refill times."""

    __slots__ = ("_inflight", "_qps", "_tokens", "_token_rate", "_new_book", "_registry")

    def __init__(self, new_book: NewBook | None, registry: Appointments | None = None) -> None:
        self._new_book = new_book
        self._registry = registry  # where the rate caps' prepaid books are kept (None: nothing kept)
        self._inflight = Refusal(YieldReason.TENANT_INFLIGHT)
        self._qps = Refusal(YieldReason.TENANT_QPS)
        self._tokens = Refusal(YieldReason.TENANT_TOKENS)
        self._token_rate = Refusal(YieldReason.TENANT_TOKEN_RATE)

    @staticmethod
    def fits(ask: Ask) -> None:
        """OverBudget when the request alone exceeds one of its tenant's token caps: a yield would never end."""
        tenant = ask.tenant
        if tenant is None:
            return
        budget = tenant.limits.max_inflight_tokens
        if budget and ask.cost > budget:
            raise over_budget(ask, budget, f"tenant {tenant.name}'s max_inflight_tokens")
        bucket = tenant.token_bucket
        if bucket is not None and ask.cost > bucket.burst:
            raise over_budget(ask, int(bucket.burst), f"tenant {tenant.name}'s tokens_burst")

    def check(self, now: float, ask: Ask) -> Refusal | None:
        """The first of its tenant's caps to refuse `ask`, in this order: `max_inflight`, `max_qps`,
        `max_inflight_tokens`, `max_tokens_per_s`. Each is asked only when the tenant has it."""
        tenant = ask.tenant
        if tenant is None:
            return None
        limits = tenant.limits
        if limits.max_inflight:
            refused = self._inflight_cap(now, ask, tenant)
            if refused is not None:
                return refused
        bucket = tenant.qps_bucket
        if bucket is not None:
            refused = self._qps_cap(now, ask, tenant, bucket)
            if refused is not None:
                return refused
        if limits.max_inflight_tokens:
            refused = self._tokens_cap(now, ask, tenant)
            if refused is not None:
                return refused
        bucket = tenant.token_bucket
        if bucket is not None:
            return self._token_rate_cap(now, ask, tenant, bucket)
        return None

    def _inflight_cap(self, now: float, ask: Ask, tenant: Tenant) -> Refusal | None:
        """`max_inflight` (under the class's ceiling), with what the tenant's appointments keep."""
        limit = tenant.limits.max_inflight * ask.ceiling
        book = tenant.inflight_book
        if tenant.inflight + 1 <= limit and (
            book is None or not book.entries or tenant.inflight + 1 + book.held(now, ask.appointment, ask.rank) <= limit
        ):
            return None
        refusal = self._inflight
        deficit = tenant.inflight + 1 - math.floor(limit)
        if self._new_book is None:  # --retry-hint fixed: the drain's base hint, nothing kept
            refusal.appointment = None
            return refusal.at(tenant.request_drain.hint_ms(now, deficit, 1, tenant.inflight))
        if book is None:
            book = tenant.inflight_book = self._new_book(_TENANT_INFLIGHT, tenant)
        refusal.hint_ms, refusal.appointment = book.refuse(now, ask, deficit, 1.0)
        return refusal

    def _qps_cap(self, now: float, ask: Ask, tenant: Tenant, bucket: TokenBucket) -> Refusal | None:
        """`max_qps`: a token from its bucket (a refusal pays for it at once, in its prepaid book)."""
        book = tenant.qps_book
        if book is None and self._registry is not None:
            book = tenant.qps_book = PrepaidBook(_TENANT_QPS, self._registry, True, lambda: tenant.qps_bucket)
        return bucket_refusal(self._qps, bucket, book, now, ask, 1.0, ask.ceiling)

    def _tokens_cap(self, now: float, ask: Ask, tenant: Tenant) -> Refusal | None:
        """`max_inflight_tokens` (under the class's ceiling), with what the tenant's appointments keep."""
        excess = tenant.tokens + ask.cost - tenant.limits.max_inflight_tokens * ask.ceiling
        book = tenant.tokens_book
        if excess <= 0 and (
            book is None or not book.entries or excess + book.held(now, ask.appointment, ask.rank) <= 0
        ):
            return None
        refusal = self._tokens
        if self._new_book is None:  # --retry-hint fixed: the drain's base hint, nothing kept
            refusal.appointment = None
            return refusal.at(tenant.token_drain.hint_ms(now, excess, ask.cost, tenant.tokens))
        if book is None:
            book = tenant.tokens_book = self._new_book(_TENANT_TOKENS, tenant)
        refusal.hint_ms, refusal.appointment = book.refuse(now, ask, excess, ask.cost)
        return refusal

    def _token_rate_cap(self, now: float, ask: Ask, tenant: Tenant, bucket: TokenBucket) -> Refusal | None:
        """`max_tokens_per_s`: the request's cost from its bucket (a refusal pays for it at once)."""
        book = tenant.token_rate_book
        if book is None and self._registry is not None:
            book = tenant.token_rate_book = PrepaidBook(
                _TENANT_TOKEN_RATE, self._registry, False, lambda: tenant.token_bucket
            )
        return bucket_refusal(self._token_rate, bucket, book, now, ask, ask.cost, ask.ceiling)

    def charge(self, grant: Grant, now: float) -> None:
        tenant = grant.ask.tenant
        if tenant is None:
            return
        tenant.inflight += 1
        tenant.tokens += grant.ask.cost
        for book in (tenant.inflight_book, tenant.tokens_book):
            if book is not None and book.entries:
                book.redeem(grant.ask.appointment, now)
        if tenant.qps_bucket is not None:
            bucket_charge(tenant.qps_bucket, tenant.qps_book, grant, now, 1.0)
        if tenant.token_bucket is not None:
            bucket_charge(tenant.token_bucket, tenant.token_rate_book, grant, now, grant.ask.cost)

    def refund(self, grant: Grant) -> None:
        tenant = grant.ask.tenant
        if tenant is not None and tenant.qps_bucket is not None:
            tenant.qps_bucket.refund()  # the rest is freed by `release`, as for any request that ends

    def release(self, grant: Grant, executed: bool) -> None:
        tenant = grant.ask.tenant
        if tenant is None:
            return
        if tenant.inflight <= 0 or tenant.tokens < grant.ask.cost:
            raise RuntimeError("release() without a matching charge")
        tenant.inflight -= 1
        tenant.tokens -= grant.ask.cost
        bucket: TokenBucket | None = tenant.token_bucket
        if bucket is not None:
            bucket.refund(grant.ask.cost - grant.used)

    @staticmethod
    def room(grant: Grant, now: float) -> float:
        """The request's tenant's own room: its slots and tokens under its class's ceiling, its buckets."""
        ask = grant.ask
        tenant = ask.tenant
        if tenant is None:
            return math.inf
        own, ceiling, cost = tenant.limits, ask.ceiling, max(1, ask.cost)
        return min(
            cap_room(own.max_inflight * ceiling, tenant.inflight, 1),
            cap_room(own.max_inflight_tokens * ceiling, tenant.tokens, cost),
            bucket_room(tenant.qps_bucket, 1.0, ceiling, now),
            bucket_room(tenant.token_bucket, cost, ceiling, now),
        )
