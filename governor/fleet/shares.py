"""This replica's share of each fleet limit, and the demand it measures for the next renewal.

A `Share` is what the lease lets this replica use of one fleet limit: it refuses what would pass
it (`over`), and each refusal counts the client it told to wait for as long as the hint says
(`WaitLedger`), so that a renewal reports what waited here on average over the period (`report`),
whatever the hints were computed from. `HeldShare`: what running requests hold (slots, token
cost), and for the in-flight share the appointments it promised (lease.py books them): reported
as wanted, and those due before the renewal after next as capacity the share must keep
(`kept`); `RateShare`: a limit per second, run as a local token bucket. The lease (lease.py) holds
one per fleet limit (two of each) and sets them from each reply; the design is the package's
docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from governor.admission.appointments.books import MIN_TRUST
from governor.admission.buckets import TokenBucket
from governor.admission.hints import DrainHint, RetryHintEstimator
from governor.admission.limits import Refusal, hint_of
from govwire.vocab import YieldReason

if TYPE_CHECKING:
    from governor.admission.appointments.books import AppointmentBook

HELD_HORIZON_S = 30.0
RATE_HORIZON_S = 1.0


class Lease(Protocol):
    """The lease, as a share sees it: a refusal only the next renewal can lift hints at its reply."""

    def renewal_hint(self, now: float) -> int: ...


class WaitLedger:
    """How many clients wait on a share, integrated over time: a refused client waits from its
    refusal until its hint runs out (when it comes back and, refused again, waits anew), so the
    count is a step function, +amount at the refusal and -amount when its hint ends. `take_area`
    returns its integral since the last call (amount-seconds), exactly to a slot: a client told
    to wait longer than a renewal period counts in every period it waits through, and one that
    does not come back stops counting when its hint ends — a replica whose clients left asks for
    nothing a period later. A refusal costs a dict update (keyed by the slot its wait ends in) and
    the sweep of the slots passed since the last one (5 ms each, while anyone waits)."""

    SLOT_S = 0.005

    __slots__ = ("horizon_s", "_slot", "_count", "_area", "_ends")

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s  # the longest wait it counts
        self._slot = 0  # the slot swept up to (time / SLOT_S)
        self._count = 0.0  # waiting now
        self._area = 0.0  # since the last `take_area`
        self._ends: dict[int, float] = {}  # slot -> amount whose wait ends there

    def _sweep(self, now: float) -> None:
        target = int(now / self.SLOT_S)
        if not self._ends:  # nobody waits: nothing to integrate
            self._slot = target
            return
        ends, slot, count, area = self._ends, self._slot, self._count, self._area
        while slot < target:
            slot += 1
            area += count * self.SLOT_S
            if slot in ends:
                count -= ends.pop(slot)
                if not ends:
                    count, slot = 0.0, target
        self._slot, self._count, self._area = slot, max(0.0, count), area

    def add(self, now: float, amount: float, wait_s: float) -> None:
        """`amount` waits from now for `wait_s`, counted for at most the ledger's horizon."""
        wait_s = min(wait_s, self.horizon_s)
        self._sweep(now)
        self._count += amount
        end = max(self._slot + 1, int((now + wait_s) / self.SLOT_S))
        self._ends[end] = self._ends.get(end, 0.0) + amount

    def take_area(self, now: float) -> float:
        """The count's integral (amount-seconds) since the last call, up to `now`: a renewal divides
        it by its period for how many waited on average; the next period starts from nothing."""
        self._sweep(now)
        area, self._area = self._area, 0.0
        return area

    def waiting_at(self, now: float) -> float:
        """How many wait at `now`: refused, their hints not yet run out."""
        self._sweep(now)
        return self._count


class Share:
    """This replica's share of one fleet limit, and what it measures for the next renewal: how
    many clients its refusals told to wait, on average over the period (WaitLedger), whatever
    the hints were computed from."""

    __slots__ = (
        "limit",
        "share",
        "refusals",
        "ledger",
        "largest",
        "fleet_usage",
        "fleet_want",
        "fleet_granted",
        "refusal",
    )

    def __init__(self, reason: YieldReason, horizon_s: float) -> None:
        self.limit: float = 0  # the fleet limit; 0 = not shared
        self.share = 0.0  # the lease: what this replica enforces now
        self.refusals = 0  # frames the share refused since the last report
        self.ledger = WaitLedger(horizon_s)  # and the clients they told to wait, over time
        self.largest = 1.0  # the largest request it refused since the last report (at least 1)
        self.fleet_usage = 0.0  # the fleet's usage and wants, as of the last reply
        self.fleet_want = 0.0
        self.fleet_granted = 0.0  # what Redis keeps reserved for every replica, this one's share included
        self.refusal = Refusal(reason)

    def refuse(self, now: float, amount: float, hint_ms: int) -> Refusal:
        """Count a refusal of `amount` told to come back in `hint_ms`, and return it."""
        self.refusals += 1
        self.ledger.add(now, amount, hint_ms / 1000.0)
        if amount > self.largest:
            self.largest = amount
        refusal = self.refusal
        refusal.hint_ms = hint_ms
        refusal.appointment = None
        return refusal

    def waiting(self, now: float, elapsed_s: float) -> float:
        """How much waited here on average over the period that ends now; a new period starts."""
        self.refusals, self.largest = 0, 1.0
        return self.ledger.take_area(now) / elapsed_s

    def report(self, now: float, elapsed_s: float, soon_s: float) -> tuple[float, ...]:
        """The script's seven numbers (limit, usage, want, applied, held kind, least share, kept:
        what the appointments due within `soon_s` count on); a new measurement period starts
        when `elapsed_s` (the one that ends) is not 0."""
        raise NotImplementedError

    def set_share(self, share: float, now: float) -> None:
        self.share = share

    @property
    def used(self) -> float:
        """What this replica uses of it now (held) or did over the last period (per second)."""
        raise NotImplementedError

    def over(self, now: float, amount: int, ceiling: float, lease: Lease) -> Refusal | None:
        """A refusal when `amount` more would pass the share (under the class ceiling)."""
        raise NotImplementedError


class HeldShare(Share):
    """A fleet limit on what running requests hold (requests or token cost): the share is a
    whole number of them."""

    __slots__ = ("holding", "want", "asked", "drain", "reported", "target", "shrinking_since", "book")

    def __init__(self, reason: YieldReason, hints: RetryHintEstimator) -> None:
        # A client waits as long as the release timeline says (a long request, a long wait),
        # within the hints' own clamp.
        super().__init__(reason, HELD_HORIZON_S)
        self.holding = 0
        self.want = 0.0  # as of the last measured period
        self.asked = 0.0  # what the last report wanted (its promises included)
        self.drain = DrainHint(hints)
        self.reported = 0  # what it held at the last report (Redis keeps at least that reserved)
        self.target = 0.0  # as of the last reply: the share the fleet's demand gives it
        # Since when the fleet's demand gives it less than its share (None: not now): what it
        # promised since was counted against that smaller share (lease.FleetLease._promise).
        self.shrinking_since: float | None = None
        # The appointments its refusals promised (the in-flight share's, lease.FleetLease.keep);
        # None: nothing is kept (--retry-hint fixed, or a token share).
        self.book: AppointmentBook | None = None

    def giving_back(self, now: float) -> bool:
        """Whether a renewal now would free capacity other replicas wait for: the fleet wanted
        more than the limit at the last reply, and since the last report this replica's requests
        above a share that shrank have ended, or most of a share of two or more lies idle (held
        by nobody, awaited by no client here; a share of one is the least a replica that wants any
        keeps, so renewing for it would change nothing)."""
        if not self.limit or self.fleet_want <= self.limit:
            return False
        if self.reported > self.share >= self.holding:
            return True
        unused = self.share - self.holding - self.ledger.waiting_at(now)
        return self.share >= 2 and unused >= max(1.0, self.share / 2)

    def take(self, amount: int) -> None:
        self.holding += amount

    def give(self, amount: int) -> None:
        if self.holding < amount:
            raise RuntimeError("release() without a matching charge")
        self.holding -= amount

    @property
    def used(self) -> float:
        return self.holding

    def over(self, now: float, amount: int, ceiling: float, lease: Lease) -> Refusal | None:
        """A refusal when `amount` more would not fit the share (under the class ceiling); its
        hint, the time what this replica holds takes to drain enough, or the next renewal when it
        holds nothing."""
        if self.holding + amount <= self.share * ceiling:
            return None
        if not self.holding:
            return self.refuse(now, amount, lease.renewal_hint(now))
        excess = self.holding + amount - self.share * ceiling
        return self.refuse(now, amount, self.drain.hint_ms(now, excess, amount, self.holding))

    def report(self, now: float, elapsed_s: float, soon_s: float) -> tuple[float, ...]:
        """It wants what it holds plus what waited for it, and at least what it holds plus what
        it promised; its least share holds the largest request it refused. It keeps (the share
        may not shrink below, up to what it applies) what it holds plus the appointments due
        within `soon_s`, which were promised this replica's releases under the share in force."""
        least = self.largest
        if elapsed_s > 0:
            self.want = self.holding + self.waiting(now, elapsed_s)
        self.reported = self.holding
        want, kept = self.want, 0.0
        book = self.book
        if book is not None and book.entries:
            # Only the appointments that keep their slots (those of ranks whose clients come back:
            # books.MIN_TRUST): a flood that never comes back asks for nothing it would not use.
            trust = book.trust
            promised = [e for e in book.entries if trust[e.rank] >= MIN_TRUST]
            want = max(want, self.holding + len(promised))
            # Kept: those due soon that were promised under the share in force, not those promised
            # since the demand gave it less (counted against that already), or the share would
            # never move while its clients keep coming.
            since = self.shrinking_since
            soon = now + soon_s
            due = sum(1 for e in promised if e.at <= soon and (since is None or e.booked_at < since))
            if due:  # (with none due, what it holds keeps no share: it gives back as its requests end)
                kept = min(self.share, self.holding + due)
        self.asked = want
        return self.limit, self.holding, want, self.share, 1, least, kept


class RateShare(Share):
    """A fleet limit per second (admissions or token cost): the share runs a local token bucket."""

    __slots__ = ("burst", "bucket", "admitted", "rate", "want")

    def __init__(self, reason: YieldReason) -> None:
        # A rate's hint is its bucket's refill at this replica's share, which a renewal may change at
        # once: a client told to wait past a lease is counted for a lease.
        super().__init__(reason, RATE_HORIZON_S)
        self.burst = 0.0  # the fleet's burst
        self.bucket: TokenBucket | None = None  # None: no share big enough for one request
        self.admitted = 0.0  # since the last report
        self.rate = 0.0  # admitted per second over the last measured period
        self.want = 0.0  # and what it wanted per second

    @property
    def used(self) -> float:
        return self.rate

    def over(self, now: float, amount: int, ceiling: float, lease: Lease) -> Refusal | None:
        """A refusal when the bucket cannot give `amount` now (keeping what the class ceiling
        keeps); its hint, the bucket's refill, or the next renewal when its share is too small."""
        bucket = self.bucket
        if bucket is None:
            return self.refuse(now, amount, lease.renewal_hint(now))
        floor = (1.0 - ceiling) * bucket.burst  # what a class ceiling keeps in the bucket
        if bucket.level(now) - amount < floor:
            return self.refuse(now, amount, hint_of(bucket.appointment_s(now, amount + floor)))
        return None

    def report(self, now: float, elapsed_s: float, soon_s: float) -> tuple[float, ...]:
        """It wants, per second, what it admitted plus what waited for it, to be served within a
        period; its least share has a burst that holds the largest request it refused."""
        least = self.limit * self.largest / self.burst if self.burst else 0.0
        if elapsed_s > 0:
            self.rate = max(0.0, self.admitted) / elapsed_s
            self.want = self.rate + self.waiting(now, elapsed_s) / elapsed_s
            self.admitted = 0.0
        return self.limit, 0.0, self.want, self.share, 0, least, 0.0

    def set_share(self, share: float, now: float) -> None:
        """Its bucket refills at `share` per second and banks the same fraction of the fleet burst;
        a new bucket starts empty (its tokens must be earned at the share's rate)."""
        self.share = share
        burst = self.burst * share / self.limit if self.limit else 0.0
        if share <= 0 or burst < 1.0:
            self.bucket = None
            return
        old = self.bucket
        bucket = TokenBucket(share, burst, now)
        bucket.tokens = min(burst, old.level(now)) if old is not None else 0.0
        self.bucket = bucket
