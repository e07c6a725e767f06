"""The endpoint pool: per-endpoint soft caps under the global hard ones, and the routing.

A `Limit` (limits.py) that also chooses: `check` finds the least loaded endpoint that is up and
under its concurrency cap, its token budget (`tokens=N`) and its qps bucket (relative to
capacity, round-robin among equals; a client back for an endpoint_qps appointment goes where it
paid for its token), `charge` takes that endpoint's slot, tokens and bucket token.
Refusals name the endpoint limit that was hit: `endpoint_qps` with the exact wait of the bucket
that refills first when a bucket stands in the way, else `endpoint_tokens` with an appointment in
the token book of the endpoint closest to fitting (the forecast release of enough of its own
requests' cost nobody was promised, kept for the client told it), else `endpoint_inflight` with
an appointment at the next forecast release nobody was promised (release_forecast.py), or the
service-time estimate over the endpoints' summed caps when nothing can be forecast; with
`--retry-hint fixed` these two hint the base value (a drain estimate for the tokens). An
endpoint paused by its own 429/503 is skipped; when every endpoint the request fits is paused the
refusal is `endpoint_busy` with the time left of the earliest pause (its Retry-After). A request
costing more than every endpoint's token budget is an `OverBudget` error. With no endpoint up at
all it does not refuse: the request is admitted without an endpoint and fails with
`worker_unavailable` (a yield would promise a retry that cannot succeed before a worker is back).

The pool also keeps each endpoint's waiting load (requests without a first token and their
prompt tokens), which the TTFT model reads (ttft.py, deadline.py).
"""

from __future__ import annotations

import math

from governor.admission.appointments.books import AppointmentBook, NewBook, PrepaidBook
from governor.admission.appointments.registry import Appointments
from governor.admission.cost import Ask
from governor.admission.endpoint import Endpoint
from governor.admission.hints import DrainHint, RetryHintEstimator
from governor.admission.limits import (
    Grant,
    Refusal,
    bucket_charge,
    bucket_refusal,
    bucket_room,
    cap_room,
    hint_of,
    over_budget,
)
from governor.admission.release_forecast import ReleaseForecast
from govwire.vocab import YieldReason

_ENDPOINT_TOKENS = YieldReason.ENDPOINT_TOKENS.value
_ENDPOINT_QPS = YieldReason.ENDPOINT_QPS.value
_UNRANKED = (True, math.inf)  # (no budget in the way yet: `Pool._route`)


class Pool:
    def __init__(
        self,
        endpoints: list[Endpoint],
        default_capacity: int,
        hints: RetryHintEstimator,
        forecast: ReleaseForecast,
        book: AppointmentBook | None = None,
        new_tokens_book: NewBook | None = None,
        registry: Appointments | None = None,
    ) -> None:
        self.endpoints = endpoints
        # Makes an endpoint's token book on its first endpoint_tokens refusal; None with --retry-hint fixed.
        self._new_tokens_book = new_tokens_book
        # Where an endpoint's qps bucket keeps its appointments (made on its first endpoint_qps
        # refusal); None with --retry-hint fixed.
        self._registry = registry
        self._forecast = forecast
        # The endpoint_inflight appointments (appointments.py), as the global cap keeps its own;
        # None with --retry-hint fixed.
        self.book = book
        self.capped: tuple[Endpoint, ...] = ()  # the endpoints whose caps refused the last frame
        self.default_capacity = default_capacity  # what "relative to capacity" uses for uncapped endpoints
        self._hints = hints
        self._next = 0  # round-robin start among equally loaded endpoints
        self._chosen = -1  # the index of the endpoint `check` chose (-1: none), for the `charge` that follows
        self._qps_refusal = Refusal(YieldReason.ENDPOINT_QPS)
        self._inflight_refusal = Refusal(YieldReason.ENDPOINT_INFLIGHT)
        self._tokens_refusal = Refusal(YieldReason.ENDPOINT_TOKENS)
        self._busy_refusal = Refusal(YieldReason.ENDPOINT_BUSY)
        self._drains = {e: DrainHint(hints) for e in endpoints}

    def routes(self, now: float, ask: Ask) -> bool:
        """Whether an endpoint can take `ask` now (chosen for `charge`), asked for a request already
        admitted whose endpoint was lost: a refusal here hints nothing and books nothing (nobody
        would come back for it). Raises `OverBudget` as `check` does."""
        return self.check(now, ask, booking=False) is None

    @property
    def choice(self) -> Endpoint | None:
        """The endpoint the last passing `check` chose (read by the deadline check that follows)."""
        index = self._chosen
        return None if index < 0 else self.endpoints[index]

    def check(self, now: float, ask: Ask, booking: bool = True) -> Refusal | None:
        """The least loaded endpoint that can take `ask` now, chosen for `charge`; else the refusal,
        its hint and (`booking`) its appointment. A re-route asks without `booking` (`routes`)."""
        index, usable, bucket_at, budget_at = self._route(now, ask)
        book = self.book
        if index >= 0 and (book is None or not book.entries or not self._kept_from(now, ask, book)):
            self._chosen = index
            return None
        self._chosen = -1
        return self._refusal(now, ask, booking, usable, bucket_at, budget_at)

    def _route(self, now: float, ask: Ask) -> tuple[int, bool, Endpoint | None, Endpoint | None]:
        """The index of the endpoint that would take `ask` now, -1 for none (the rules: the module's
        docstring), and what `_refusal` answers from: whether any was usable (up, not paused, `ask`
        within its token budget), the endpoint whose bucket refills first, the budget to refuse through."""
        held = ask.appointment
        paid = None if held is None or held.book.reason != _ENDPOINT_QPS else held.book
        cost, endpoints = ask.cost, self.endpoints
        n = len(endpoints)
        best, best_load, usable = -1, math.inf, False
        bucket_at, bucket_wait = None, math.inf  # the endpoint whose bucket refills first, and when
        budget_at, budget_rank = None, _UNRANKED  # the budget to refuse through (`_budget_rank`)
        for k in range(n):
            index = (self._next + k) % n
            e = endpoints[index]
            limits = e.limits
            budget = limits.tokens
            if not e.up or e.paused_until > now or (budget and cost > budget):
                continue
            usable = True
            cap = limits.concurrency
            if cap and e.inflight >= cap:
                continue
            booked = e.tokens_book
            if budget and (e.tokens + cost > budget or (booked is not None and booked.entries)):
                rank = self._budget_rank(now, ask, e)  # (never called for room with nothing booked)
                if rank is not None:
                    if budget_at is None or rank < budget_rank:
                        budget_at, budget_rank = e, rank
                    continue
            bucket = e.bucket
            if bucket is not None:
                kept = e.qps_book
                if paid is not None and paid is kept and kept.credit(now, held):
                    best, best_load = index, -math.inf  # its token is paid for here, so it goes here
                    continue
                if bucket.level(now) < 1.0:
                    wait = bucket.wait_s(now)
                    if wait < bucket_wait:
                        bucket_at, bucket_wait = e, wait
                    continue
            load = e.inflight / ((cap or self.default_capacity) * limits.weight)
            if load < best_load:
                best, best_load = index, load
        return best, usable, bucket_at, budget_at

    def _refusal(
        self, now: float, ask: Ask, booking: bool, usable: bool, bucket_at: Endpoint | None, budget_at: Endpoint | None
    ) -> Refusal | None:
        """What to answer when no endpoint can take `ask` now (or what is free where it could go is
        kept for appointments), in this order: no endpoint usable (`_unusable`); to a re-route (no
        `booking`), a bare endpoint_inflight; a qps bucket in the way; a token budget; the caps."""
        if not usable:
            return self._unusable(now, ask, booking)
        if not booking:
            return self._inflight_refusal  # (`routes`: no hint, nothing booked)
        if bucket_at is not None:
            return self._bucket_refusal(now, ask, bucket_at)
        if budget_at is not None:
            return self._budget_refusal(now, ask, budget_at)
        return self._caps_refusal(now, ask)

    @staticmethod
    def _budget_rank(now: float, ask: Ask, e: Endpoint) -> tuple[bool, float] | None:
        """None when `e`'s token budget has room for `ask` (and for what its appointments keep from
        it); else how that budget ranks as the one to refuse through: the asker's own first (a
        holder is refused through its own endpoint's book, where it keeps its place), then the
        closest to fitting, its appointments included."""
        over: float = e.tokens + ask.cost - e.limits.tokens
        kept = e.tokens_book
        if over <= 0 and kept is not None and kept.entries:
            over += kept.held(now, ask.appointment, ask.rank)
        if over <= 0:
            return None
        held = ask.appointment
        return (kept is None or held is None or kept is not held.book, over)

    def _unusable(self, now: float, ask: Ask, booking: bool) -> Refusal | None:
        """No endpoint is up, not paused and with a token budget `ask` fits in. None up: admitted
        without an endpoint (dispatch answers worker_unavailable: a yield would promise a retry
        that cannot succeed before a worker is back); too large for every one up: `OverBudget`;
        else each is paused by its 429/503: endpoint_busy until the earliest pause ends."""
        up = [e for e in self.endpoints if e.up]
        if not up:
            return None
        cost = ask.cost
        paused_until = [e.paused_until for e in up if not (e.limits.tokens and cost > e.limits.tokens)]
        if not paused_until:
            raise over_budget(ask, max(e.limits.tokens for e in up), "every endpoint's tokens=N")
        if not booking:
            return self._inflight_refusal  # (`routes`: no hint, nothing booked)
        return self._busy_refusal.at(hint_of(min(paused_until) - now))

    def _bucket_refusal(self, now: float, ask: Ask, e: Endpoint) -> Refusal | None:
        """endpoint_qps: the exact wait for `e`'s bucket, which refills first, paid for at once in
        its prepaid book (made on its first refusal there; none with --retry-hint fixed)."""
        kept = e.qps_book
        if kept is None and self._registry is not None:
            kept = e.qps_book = PrepaidBook(_ENDPOINT_QPS, self._registry, True, lambda: e.bucket)
        bucket = e.bucket
        assert bucket is not None  # (`_route` found it in the way)
        return bucket_refusal(self._qps_refusal, bucket, kept, now, ask, 1.0, 1.0)

    def _budget_refusal(self, now: float, ask: Ask, e: Endpoint) -> Refusal:
        """endpoint_tokens: an appointment in `e`'s token book (made on its first refusal there) at
        the forecast release of enough of its requests' cost; with --retry-hint fixed, its drain's
        base hint, nothing kept."""
        deficit = e.tokens + ask.cost - e.limits.tokens
        refusal = self._tokens_refusal
        if self._new_tokens_book is None:
            refusal.appointment = None
            return refusal.at(self._drains[e].hint_ms(now, deficit, ask.cost, e.tokens))
        kept = e.tokens_book
        if kept is None:
            kept = e.tokens_book = self._new_tokens_book(_ENDPOINT_TOKENS, e)
        refusal.hint_ms, refusal.appointment = kept.refuse(now, ask, deficit, ask.cost)
        return refusal

    def _caps_refusal(self, now: float, ask: Ask) -> Refusal:
        """endpoint_inflight: every endpoint it fits is at its cap (or what is free is kept for
        appointments). The next release at any of them nobody was promised, booked and kept for
        it; with --retry-hint fixed, no forecast: the estimator's base hint (`_fallback_ms`)."""
        book = self.book
        if book is None:
            return self._inflight_refusal.at(self._fallback_ms(now))
        usable = self.capped = self._usable(now, ask.cost)
        refusal = self._inflight_refusal
        refusal.hint_ms, refusal.appointment = book.refuse(now, ask, 1 - self._free(usable), 1.0)
        return refusal

    def _fallback_ms(self, now: float) -> int:
        """Nothing to forecast from: at their caps, the endpoints release a slot every service time
        / their summed caps (not the global cap the estimator's gap is computed for)."""
        hints = self._hints
        capacity = sum(e.limits.concurrency or self.default_capacity for e in self.endpoints if e.up)
        return hints.hint_ms(now, hints.capacity / capacity if capacity else 1.0)

    def _usable(self, now: float, cost: int) -> tuple[Endpoint, ...]:
        """The endpoints a frame of this cost could be sent to but for their concurrency caps: up,
        not paused, its cost within their token budget."""
        return tuple(
            e
            for e in self.endpoints
            if e.up and e.paused_until <= now and not (e.limits.tokens and cost > e.limits.tokens)
        )

    @staticmethod
    def _free(endpoints: tuple[Endpoint, ...]) -> int:
        """Their free slots (an uncapped endpoint counts for one: it always has room)."""
        free = 0
        for e in endpoints:
            cap = e.limits.concurrency
            if not cap:
                return free + 1
            if e.inflight < cap:
                free += cap - e.inflight
        return free

    def _kept_from(self, now: float, ask: Ask, book: AppointmentBook) -> bool:
        """Whether the slots free at the endpoints it could use are all kept for appointments whose
        window is open (and that outrank the asker): then the frame is refused like one that met
        the full caps. Never while an uncapped endpoint is usable: it always has room."""
        held = book.held(now, ask.appointment, ask.rank)
        if not held:
            return False
        usable = self._usable(now, ask.cost)
        if any(not e.limits.concurrency for e in usable):
            return False
        return self._free(usable) - held < 1

    def charge(self, grant: Grant, now: float) -> None:
        index, self._chosen = self._chosen, -1
        endpoint = None if index < 0 else self.endpoints[index]
        book = self.book
        if book is not None and book.entries:
            book.redeem(grant.ask.appointment, now)
        held = grant.ask.appointment
        if held is not None and held.book.reason == _ENDPOINT_TOKENS:
            # Kept at this endpoint's budget or another's (the least loaded took it): redeemed,
            # what it kept is anyone's again.
            held.book.redeem(held, now)
        paid = None if held is None else held.book
        if isinstance(paid, PrepaidBook) and paid.reason == _ENDPOINT_QPS:
            if endpoint is None or paid is not endpoint.qps_book:
                paid.redeem(held, now)  # (served elsewhere: what it paid there is spent)
        if endpoint is None:
            return  # no endpoint up: dispatch answers worker_unavailable
        if endpoint.bucket is not None:
            bucket_charge(endpoint.bucket, endpoint.qps_book, grant, now, 1.0)
        ask = grant.ask
        endpoint.inflight += 1
        endpoint.tokens += ask.cost
        # The TTFT model's features: what waits there for a first token before this request.
        grant.requests_ahead = endpoint.waiting
        grant.tokens_ahead = endpoint.waiting_tokens
        endpoint.waiting += 1
        endpoint.waiting_tokens += ask.prompt_tokens
        self._next = (index + 1) % len(self.endpoints)
        grant.endpoint = endpoint

    @staticmethod
    def room(grant: Grant, now: float) -> float:
        """The room left on the endpoint the request was routed to: its concurrency, its tokens
        over the request's cost, its bucket (its caps know no classes)."""
        endpoint = grant.endpoint
        if endpoint is None:
            return math.inf
        limits = endpoint.limits
        return min(
            cap_room(limits.concurrency, endpoint.inflight, 1),
            cap_room(limits.tokens, endpoint.tokens, max(1, grant.ask.cost)),
            bucket_room(endpoint.bucket, 1.0, 1.0, now),
        )

    def started(self, grant: Grant) -> None:
        """Its first token came: it waits no more on its endpoint."""
        endpoint = grant.endpoint
        if endpoint is not None and not grant.started:
            endpoint.waiting -= 1
            endpoint.waiting_tokens -= grant.ask.prompt_tokens
        grant.started = True

    def refund(self, grant: Grant) -> None:
        endpoint = grant.endpoint
        if endpoint is not None and endpoint.bucket is not None:
            endpoint.bucket.refund()

    def release(self, grant: Grant, executed: bool) -> None:
        endpoint = grant.endpoint
        if endpoint is None:
            return
        if endpoint.inflight <= 0:
            raise RuntimeError("release() without a matching charge")
        endpoint.inflight -= 1
        endpoint.tokens -= grant.ask.cost
        if not grant.started:
            endpoint.waiting -= 1
            endpoint.waiting_tokens -= grant.ask.prompt_tokens
