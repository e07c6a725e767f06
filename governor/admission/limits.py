"""What a limit on admission is, and the limits that apply to a request as a whole.

A `Limit` answers four questions about one request (its `Ask`: token cost and deadline), each
without I/O and with the clock passed in: may it go now (`check`, which charges nothing: a refusal
leaves no trace on any capacity, but a rate cap's, which pays at once for the tokens it promises
its client: appointments.PrepaidBook), take what it costs (`charge`), give back a charge that was never
used (`refund`: the frame turned out invalid after its admission), and give back what a running
request holds once it has ended (`release`, where a token cost is also settled with the real
counts). A refusal names its reason and its hint: how long the refused client should wait.

`admission.Admission` checks every limit before it charges any, so admission is all-or-nothing;
in a single-threaded event loop nothing can happen between the checks and the charges. Each new
kind of limit (token budgets, tenant caps, fair shares, fleet leases) is one more `Limit`. A
capacity limit counts its cap as `Ask.ceiling` of itself: the fraction the request's priority
class may fill (priority.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from governor.admission.buckets import TokenBucket, make_bucket, updated_bucket
from governor.admission.cost import NO_ASK, Ask
from governor.admission.endpoint import Endpoint
from governor.admission.hints import DrainHint, RetryHintEstimator
from govwire.errors import OverBudget
from govwire.vocab import Priority, YieldReason

_CRITICAL = Priority.CRITICAL

if TYPE_CHECKING:
    from governor.admission.appointments.appointment import Appointment
    from governor.admission.appointments.books import AppointmentBook, PrepaidBook


class Refusal:
    """A `yield`: which limit refused (a `YieldReason`'s value), the retry hint it computed
    (ms, >= 1) and, from a limit that keeps appointments (appointments.py), the one it booked for
    this client (its `ticket` goes out with the yield). `final` (set by `Admission.decide`): the
    capacity is further away than the promise horizon, so the client is told not to come back.
    A hint of `appointments.HOLD` (0) is no answer yet: the client came back for its appointment and is held
    in the lobby until its capacity frees or its promise horizon is reached (admission/appointments/lobby.py).

    Each limit owns one and refills it on every refusal (the yield path runs for every refused
    frame, and allocating an object there costs more than the rest of the decision): read it
    before asking the same limit again.
    """

    __slots__ = ("reason", "hint_ms", "appointment", "final")

    def __init__(self, reason: YieldReason, hint_ms: int = 1) -> None:
        self.reason: str = reason.value  # a plain str: it is a dict key and a JSON value per frame
        self.hint_ms = hint_ms
        self.appointment: Appointment | None = None
        self.final = False

    def at(self, hint_ms: int) -> Refusal:
        self.hint_ms = hint_ms
        return self

    def __repr__(self) -> str:
        return f"Refusal({self.reason!r}, {self.hint_ms})"


class Progress(Protocol):
    """What the lifecycle knows of a running request's stream (lifecycle.InflightRequest), which
    the release forecast reads."""

    tokens_seen: int
    t_first_token: float | None
    t_last_token: float


def hint_of(wait_s: float) -> int:
    """An exact wait in seconds as a retry hint: whole milliseconds, rounded up (past float noise:
    0.18 s is 180 ms, not 181), at least 1."""
    return max(1, math.ceil(wait_s * 1000 - 1e-6))


class Grant:
    """What one admission charged: filled in by the limits' `charge`, read back by their
    `refund` and `release`. `endpoint` is where the pool routed it (None when no endpoint was up).
    `used` is the request's real token cost, set when it ends, before `release` settles it.
    `progress` is its stream as the lifecycle counts it, read by the release forecast."""

    __slots__ = (
        "ask",
        "endpoint",
        "concurrency",
        "started",
        "tokens_ahead",
        "requests_ahead",
        "predicted_ttft_s",
        "used",
        "t_admitted",
        "progress",
        "forecast_s",
        "inflight_area",
    )

    def __init__(self, ask: Ask = NO_ASK) -> None:
        self.ask = ask
        self.endpoint: Endpoint | None = None
        self.concurrency = 0  # requests in flight once it was admitted, itself included
        self.started = False  # its first token came (it no longer waits for one on its endpoint)
        # Its endpoint's load when it was routed there: the TTFT model's features (ttft.py).
        self.tokens_ahead = 0
        self.requests_ahead = 0
        self.predicted_ttft_s: float | None = None
        self.used = 0
        self.t_admitted = 0.0
        self.progress: Progress | None = None
        self.forecast_s: float | None = None  # the first forecast of its end (release_forecast.py)
        self.inflight_area = 0.0  # Admission's in-flight x seconds at its first token (--adaptive-limit)


def over_budget(ask: Ask, budget: int, what: str) -> OverBudget:
    return OverBudget(
        f"the request costs {ask.cost} tokens ({ask.prompt_tokens} prompt + weighted max_new_tokens"
        f" {ask.max_new_tokens}), more than {what} of {budget}; it can never be admitted"
    )


class Limit(Protocol):
    def check(self, now: float, ask: Ask) -> Refusal | None:
        """None when the request may go as far as this limit is concerned. Charges nothing: a
        refusal only books the refused client's retry appointment (which a rate cap pays for at
        once)."""

    def charge(self, grant: Grant, now: float) -> None:
        """Take the request's cost; called only after every limit's `check` passed, at the same `now`."""

    def refund(self, grant: Grant) -> None:
        """Undo `charge` for a request that will not run (invalid once admitted)."""

    def release(self, grant: Grant, executed: bool) -> None:
        """The request ended (`executed`: with `done`): give back what it held while it ran."""


class Roomy(Protocol):
    """A limit that can say how much room it has (`Admission.headroom`: llm-d's headroom)."""

    def room(self, grant: Grant, now: float) -> float:
        """How many more requests like `grant`'s it would admit now, after it (math.inf: no cap);
        counted as its check would count them for the request's class."""


def cap_room(cap: float, held: float, per: float) -> float:
    """Room under a cap of `cap` (0: none) holding `held`, for requests taking `per` each."""
    return (cap - held) // per if cap else math.inf


def bucket_room(bucket: TokenBucket | None, amount: float, share: float, now: float) -> float:
    """Room in a rate bucket for requests taking `amount` each, but what a class of this `share`
    (its ceiling) leaves in it: that is not its to take."""
    if bucket is None:
        return math.inf
    return (bucket.level(now) - (1.0 - share) * bucket.burst) // amount


class SharedLimit(Limit, Roomy, Protocol):
    """A limit on capacity this governor shares with others: its lease on the fleet's caps
    (fleet/lease.py, renewed through Redis). With a fleet token budget it also refuses at once a
    request larger than that budget, as the local token budgets do."""

    @property
    def caps_tokens(self) -> bool:
        """Whether a token budget bounds what one request may cost (then `fits` applies)."""

    def fits(self, ask: Ask) -> None:
        """OverBudget for a request larger than a whole budget: no wait would let it in."""

    def keep(self, book: AppointmentBook) -> None:
        """Book the clients its in-flight share refuses in `book` (build.fleet_book)."""

    def growth(self, now: float) -> tuple[tuple[int, float], ...]:
        """The slots its renewals can add to its in-flight share, and when each comes, in order."""


class Draining:
    """While the governor drains for shutdown, every new request yields."""

    __slots__ = ("draining", "_hints", "_refusal")

    def __init__(self, hints: RetryHintEstimator) -> None:
        self.draining = False
        self._hints = hints
        self._refusal = Refusal(YieldReason.DRAINING)

    def check(self, now: float, ask: Ask) -> Refusal | None:
        return self._refusal.at(self._hints.hint_ms(now)) if self.draining else None

    def charge(self, grant: Grant, now: float) -> None:
        return None

    def refund(self, grant: Grant) -> None:
        return None

    def release(self, grant: Grant, executed: bool) -> None:
        return None


class InflightLimiter:
    """The hard cap on admitted, unfinished requests (`--max-inflight`): a non-blocking counting
    semaphore that never over-frees. Its refusals book appointments (appointments.py): the hint
    is the forecast release of the slot this client will get, and that slot is kept for it.

    A tenant with a `guaranteed_inflight` allowance that holds fewer requests than it is admitted
    past the cap (and past what appointments keep), by at most the sum of all guarantees
    (`guaranteed`): a bursty tenant finds room at once whatever the others hold, at the price of
    a larger batch for everyone while it does. A critical frame is admitted past the cap too while
    fewer than cap + `allowance` are in flight (`--class-allowance critical=D`, priority.py). A
    tenant under its fair share is lent a slot past the cap, at most `loan` past it
    (`--tenant-loan`, opt-in), while the tenants over theirs hold more than their shares by as
    much (`lend`: fair_share.FairShare.lends). So in-flight never exceeds the cap + the largest
    of the three. Everyone else waits until in-flight is back under
    the cap.

    A slot kept for an appointment (its window open) is lent to a newcomer whose forecast service
    time ends before that appointment (a backfill, `governor_backfilled_total`): the slot is due
    back before its holder, and a borrower that overruns its forecast leaves the holder in the
    lobby until a slot frees (the holder's appointment stays in the book and keeps the next
    release from everyone else), never past the cap."""

    __slots__ = (
        "max_inflight",
        "inflight",
        "guaranteed",
        "allowance",
        "lend",
        "loan",
        "backfilled",
        "_service_of",
        "_lent",
        "_hints",
        "_refusal",
        "book",
    )

    def __init__(
        self,
        max_inflight: int,
        hints: RetryHintEstimator,
        book: AppointmentBook | None = None,
        service_of: Callable[[Ask], float | None] | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.max_inflight = max_inflight
        self.inflight = 0
        self.guaranteed = 0  # the sum of the tenants' guaranteed_inflight
        self.allowance = 0  # how far past the cap critical frames are admitted
        # Whether a frame refused by the full cap is lent a slot past it (its tenant under its fair
        # share: fair_share.FairShare.lends); None while fair shares do not apply.
        self.lend: Callable[[float, Ask], bool] | None = None
        self.loan = 0  # how far past the cap `lend` may admit (--tenant-loan; 0: never)
        self.backfilled = 0  # admissions into a slot kept for an appointment due later (a backfill)
        # How long the request of an ask would hold its slot (release_forecast.service_of); None:
        # no backfill.
        self._service_of = service_of
        self._lent: Ask | None = None  # the ask its last check lent a kept slot to (counted at charge)
        self._hints = hints
        self._refusal = Refusal(YieldReason.INFLIGHT)
        self.book = book  # None: the estimator's hints, nothing kept (--retry-hint fixed)

    def set_max(self, max_inflight: int) -> None:
        """Live change: a lower cap stops new admissions until in-flight falls under it."""
        self.max_inflight = max_inflight
        self._hints.set_capacity(max_inflight)

    def check(self, now: float, ask: Ask) -> Refusal | None:
        cap = self.max_inflight * ask.ceiling
        book = self.book
        if self.inflight + 1 <= cap:
            if book is None or not book.entries or self.inflight + 1 + book.held(now, ask.appointment, ask.rank) <= cap:
                return None  # (at the cap, what appointments hold cannot matter: not looked at)
            if self._backfills(now, ask, book, int(cap) - self.inflight):
                return None
        if self.guaranteed and self.inflight < self.max_inflight + self.guaranteed:
            tenant = ask.tenant
            if tenant is not None and tenant.inflight < tenant.limits.guaranteed_inflight:
                return None  # within its guarantee
        if self.allowance and ask.priority is _CRITICAL and self.inflight < self.max_inflight + self.allowance:
            return None  # within the critical allowance
        lend = self.lend
        if lend is not None and self.inflight < self.max_inflight + self.loan and lend(now, ask):
            return None  # a tenant under its share, lent a slot the tenants over theirs hold
        refusal = self._refusal
        deficit = self.inflight + 1 - int(cap)  # int: floor of a cap > 0
        if book is None:
            refusal.hint_ms = self._hints.hint_ms(now, deficit)
            return refusal
        refusal.hint_ms, refusal.appointment = book.refuse(now, ask, deficit, 1.0)
        return refusal

    def _backfills(self, now: float, ask: Ask, book: AppointmentBook, free: int) -> bool:
        """Whether the frame may borrow one of the `free` slots the open appointments keep: its
        forecast service time (release_forecast.service_of) ends before the appointment that
        would go without (`AppointmentBook.due`). Nothing is lent before a stream has taught the
        forecast its speed."""
        service_of = self._service_of
        service_s = None if service_of is None else service_of(ask)
        if service_s is None or now + service_s > book.due(now, ask.appointment, ask.rank, free):
            return False
        self._lent = ask
        return True

    def charge(self, grant: Grant, now: float) -> None:
        self.inflight += 1
        grant.concurrency = self.inflight
        if grant.ask is self._lent:
            self.backfilled += 1
            self._lent = None
        book = self.book
        if book is not None and book.entries:
            book.redeem(grant.ask.appointment, now)

    def refund(self, grant: Grant) -> None:
        return None  # the slot is freed by `release`, as for any request that ends

    def release(self, grant: Grant, executed: bool) -> None:
        if self.inflight <= 0:
            # A double release would silently raise the effective cap; fail loudly instead.
            raise RuntimeError("release() without a matching charge")
        self.inflight -= 1

    def room(self, grant: Grant, now: float) -> float:
        """Free slots under its class's ceiling, less what the open appointments keep from it."""
        ask = grant.ask
        book = self.book
        kept = book.held(now, None, ask.rank) if book is not None and book.entries else 0.0
        return cap_room(self.max_inflight * ask.ceiling, self.inflight + kept, 1)


def bucket_refusal(
    refusal: Refusal,
    bucket: TokenBucket,
    book: PrepaidBook | None,
    now: float,
    ask: Ask,
    amount: float,
    ceiling: float,
) -> Refusal | None:
    """A rate cap's answer to `ask`, which takes `amount` from `bucket` (and may leave it no lower
    than what `ceiling`, its class's, keeps of the burst): None when it may go (the bucket holds
    what its appointment in `book` did not pay for already); else the refusal, whose hint is exact.
    With a book (appointments.PrepaidBook) the refusal pays for its client's tokens at once and
    books the time they are there, and a holder before its time is told the time left; without
    one (`--retry-hint fixed`), the next refill nobody was told of, nothing kept."""
    credit = 0.0
    if book is not None and book.entries:
        paid = book.credit(now, ask.appointment)
        if paid is None:  # before its time
            refusal.hint_ms, refusal.appointment = book.refuse(now, ask, 0.0, amount)
            return refusal
        if amount <= paid:
            return None  # paid for at its refusal
        credit = paid
    need = amount - credit + (1.0 - ceiling) * bucket.burst
    deficit = need - bucket.level(now)
    if deficit <= 0:
        return None
    if book is None:
        refusal.appointment = None
        return refusal.at(hint_of(bucket.appointment_s(now, need)))
    refusal.hint_ms, refusal.appointment = book.refuse(now, ask, deficit, amount)
    return refusal


def bucket_charge(bucket: TokenBucket, book: PrepaidBook | None, grant: Grant, now: float, amount: float) -> None:
    """Take what an admitted request costs a rate cap, but what its appointment paid for."""
    if book is not None and book.entries:
        amount = book.pay(grant.ask.appointment, now, amount)
    if amount:
        bucket.take(amount)


class RateLimit:
    """The cap on admissions per second over all endpoints (`--max-qps`, `--qps-burst`); a
    token bucket, so its hint is exact: when the tokens it needs are there, paid for at once and
    kept for it (`bucket_refusal`)."""

    __slots__ = ("bucket", "book", "_refusal")

    def __init__(self, qps: float, burst: float, now: float, book: PrepaidBook | None = None) -> None:
        self.bucket = make_bucket(qps, burst, now)
        self.book = book  # None: nothing kept (--retry-hint fixed)
        self._refusal = Refusal(YieldReason.QPS)

    def set_rate(self, qps: float, burst: float, now: float) -> None:
        self.bucket = updated_bucket(self.bucket, qps, burst, now)
        if self.book is not None:
            self.book.rebucket()

    def check(self, now: float, ask: Ask) -> Refusal | None:
        bucket = self.bucket
        return None if bucket is None else bucket_refusal(self._refusal, bucket, self.book, now, ask, 1.0, ask.ceiling)

    def charge(self, grant: Grant, now: float) -> None:
        if self.bucket is not None:
            bucket_charge(self.bucket, self.book, grant, now, 1.0)

    def refund(self, grant: Grant) -> None:
        if self.bucket is not None:
            self.bucket.refund()

    def release(self, grant: Grant, executed: bool) -> None:
        return None  # an admission per second is spent once admitted

    def room(self, grant: Grant, now: float) -> float:
        return bucket_room(self.bucket, 1.0, grant.ask.ceiling, now)


class TokenBudget:
    """The cap on the token cost held by admitted, unfinished requests (`--max-inflight-tokens`):
    what `max_inflight` is to requests, for their cost. A request holds its reserved cost until it
    ends; its hint is the time the held tokens take to drain enough for it."""

    __slots__ = ("max_tokens", "held", "_drain", "_refusal", "book")

    def __init__(self, max_tokens: int, hints: RetryHintEstimator, book: AppointmentBook | None = None) -> None:
        self.max_tokens = max_tokens  # 0 = no budget
        self.held = 0
        self._drain = DrainHint(hints)
        self._refusal = Refusal(YieldReason.TOKENS)
        self.book = book  # None: the drain estimate, nothing kept (--retry-hint fixed)

    def fits(self, ask: Ask) -> None:
        """OverBudget when the request alone exceeds the budget: a yield would never end."""
        if self.max_tokens and ask.cost > self.max_tokens:
            raise over_budget(ask, self.max_tokens, "--max-inflight-tokens")

    def check(self, now: float, ask: Ask) -> Refusal | None:
        deficit = self.held + ask.cost - self.max_tokens * ask.ceiling
        book = self.book
        if deficit <= 0 and (
            book is None or not book.entries or deficit + book.held(now, ask.appointment, ask.rank) <= 0
        ):
            return None
        refusal = self._refusal
        if book is None:
            return refusal.at(self._drain.hint_ms(now, deficit, ask.cost, self.held))
        refusal.hint_ms, refusal.appointment = book.refuse(now, ask, deficit, ask.cost)
        return refusal

    def charge(self, grant: Grant, now: float) -> None:
        self.held += grant.ask.cost
        book = self.book
        if book is not None and book.entries:
            book.redeem(grant.ask.appointment, now)

    def refund(self, grant: Grant) -> None:
        return None  # the tokens are freed by `release`, as for any request that ends

    def release(self, grant: Grant, executed: bool) -> None:
        if self.held < grant.ask.cost:
            raise RuntimeError("release() without a matching charge")
        self.held -= grant.ask.cost

    def room(self, grant: Grant, now: float) -> float:
        """Free tokens over the request's cost under its class's ceiling, less what the open
        appointments keep."""
        ask = grant.ask
        book = self.book
        kept = book.held(now, None, ask.rank) if book is not None and book.entries else 0.0
        return cap_room(self.max_tokens * ask.ceiling, self.held + kept, max(1, ask.cost))


class TokenRate:
    """The cap on token cost admitted per second (`--max-tokens-per-s`, `--tokens-burst`): the
    tokens-per-minute limit providers bill by, as a bucket of tokens. A request takes its reserved
    cost at admission; at its end the difference with its real cost goes back (an early
    end-of-sequence) or is taken too (a prompt longer than declared), so over time the bucket
    admits exactly its rate of real tokens. The hint is exact: when the bucket holds the cost, paid
    for at once and kept for it (`bucket_refusal`)."""

    __slots__ = ("bucket", "book", "_refusal")

    def __init__(self, rate: float, burst: float, now: float, book: PrepaidBook | None = None) -> None:
        self.bucket = make_bucket(rate, burst, now)
        self.book = book  # None: nothing kept (--retry-hint fixed)
        self._refusal = Refusal(YieldReason.TOKEN_RATE)

    def set_rate(self, rate: float, burst: float, now: float) -> None:
        self.bucket = updated_bucket(self.bucket, rate, burst, now)
        if self.book is not None:
            self.book.rebucket()

    def fits(self, ask: Ask) -> None:
        bucket = self.bucket
        if bucket is not None and ask.cost > bucket.burst:
            raise over_budget(ask, int(bucket.burst), "the --tokens-burst")

    def check(self, now: float, ask: Ask) -> Refusal | None:
        bucket = self.bucket
        return (
            None
            if bucket is None
            else bucket_refusal(self._refusal, bucket, self.book, now, ask, ask.cost, ask.ceiling)
        )

    def charge(self, grant: Grant, now: float) -> None:
        if self.bucket is not None:
            bucket_charge(self.bucket, self.book, grant, now, grant.ask.cost)

    def refund(self, grant: Grant) -> None:
        return None  # settled by `release` (a request that never ran used 0)

    def release(self, grant: Grant, executed: bool) -> None:
        if self.bucket is not None:
            self.bucket.refund(grant.ask.cost - grant.used)

    def room(self, grant: Grant, now: float) -> float:
        return bucket_room(self.bucket, max(1, grant.ask.cost), grant.ask.ceiling, now)
