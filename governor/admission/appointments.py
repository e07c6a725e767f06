"""Appointments: a retry hint that binds. The refused client is told when a slot will be free for
it, and that slot is kept for it when it comes.

Each capacity limit that refuses with a forecast hint (the global in-flight cap, the token budget,
the endpoint caps) has an `AppointmentBook`. A refusal books the next release nobody was promised
yet (the release forecast, release_forecast.py), if it comes within the promise horizon (else the
refusal is final and books nothing), and tells the client that time, less what holders are late
on average ("be here by"; no jitter: the lobby lets in returns that coincide one release at a
time). Around its time, in a window `grace` wide
(`--appointment-grace-ms`), the appointment holds what it was promised: the limit counts it as
taken, so a frame without that appointment is refused while the window lasts, and the client who
holds it is admitted when it comes. If it does not come, the window closes, the appointment
leaves the book and the capacity is anyone's: a no-show idles a slot at most `grace`.

The holder is recognised two ways (`Appointments.find`):
- by its ticket, the `retry_ticket` its yield carried and the retry sends back: random, unguessable,
  single use, valid only for the tenant it was issued to;
- by what it re-sends, for clients that know nothing of tickets: the same tenant re-sending the
  same request (the door's `Ask.identity`, which names the tenant). An NDJSON frame's id and
  prompt name one client's request: re-sent, it is that client, whenever it comes. An HTTP body
  may come from several clients (a load generator's fixed prompt): each refused one gets an
  appointment of its own, and a frame is taken for the holder of the earliest one whose window
  is open; before its window nothing tells a holder coming back early from another client, so
  without a ticket it is a new client.

Anything else (unknown, forged, expired, reused or another tenant's ticket) is no ticket: never an
error and never a slot. A holder that comes before its window is refused again with the time still
left and keeps its appointment (unless the limit has room for it anyway). A holder that comes
inside its window but finds the capacity still taken (the forecast was early) is `HOLD`: its door
parks it in the lobby (governor/lobby.py) until the capacity frees or its promise horizon is
reached, when it is refused for good. (Without a lobby, as in this core's own tests, it keeps its
place ahead of the appointments made after it, and its ticket, and is told the next release at
least half a window away.)
Holds never let anyone past a cap: they only decide who gets what the cap allows.

Every return is counted by outcome (`OUTCOMES`): the only way to know in production whether the
hints hold. When most appointments of a book and rank lapse unkept (a flood that never comes
back), those stop keeping capacity until clients come back for theirs again (`AppointmentBook.trust`:
per book and rank, so one class's or one tenant's no-shows unbind no one else's). The book is
bounded (`max_entries`): past it a refusal gets the forecast without an appointment. Sans-IO, with the clock passed in.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

from governor.admission.priority import RANKS, STANDARD_RANK

if TYPE_CHECKING:
    from governor.admission.buckets import TokenBucket
    from governor.admission.hints import RetryHintEstimator

Owner = object
"""The tenant an appointment was booked for (tenant.Tenant): compared by identity only (a ticket
is valid for its own tenant), so this module needs to know nothing else of tenants (whose own
caps keep books of these)."""

ON_TIME, EARLY, LATE, YIELDED_AGAIN, NEVER = "on_time", "early", "late", "yielded_again", "never"
REFUSED_ELSEWHERE = "refused_elsewhere"
OUTCOMES = (ON_TIME, EARLY, LATE, YIELDED_AGAIN, REFUSED_ELSEWHERE, NEVER)
"""What became of a retry hint: the holder came in its window and was admitted; came before it;
came after it (and was treated as a new client); came in it but the capacity was still taken;
came in it but another limit refused it (its appointment went back: not the forecast's fault); or
never came back (counted when its appointment lapses out of memory)."""

HOLD = 0
"""The hint of a refusal that is no answer yet (limits.Refusal): its holder came back in its window
before its capacity freed and waits in the lobby. Never a real hint, which is >= 1."""

LATENESS_SMOOTHING = 0.1
"""EWMA weight of the newest delay between an appointment and its holder's admission."""

HINT_RESOLUTION_S = 0.001

TRUST_WEIGHT = 0.05
"""EWMA weight of the newest appointment's fate (kept by its client: 1; lapsed: 0) in the trust."""

PROBE_EVERY = 8
"""While a book's rank keeps nothing, one refusal in this many books an appointment all the same:
a probe whose client's return brings trust back."""

MIN_TRUST = 0.5
"""Below this share of a book's appointments of one rank kept, those stop keeping capacity: a
flood of clients that never come back would otherwise hold every slot it was promised, one window
after another, for the whole horizon it booked, while the capacity idles. Their hints then are the
plain forecast; keeping resumes as clients come back (`AppointmentBook.trust`)."""

LAPSED_MEMORY_S = 30.0
"""An appointment whose window closed is remembered this long, so that a late return is counted
`late` rather than as a new client; after that it counts `never`."""


class Appointment:
    __slots__ = (
        "at",
        "amount",
        "book",
        "tenant",
        "identity",
        "ticket",
        "closes",
        "displaced",
        "rank",
        "in_lobby",
        "last_call",
        "came_at",
        "booked_at",
    )

    def __init__(
        self,
        at: float,
        amount: float,
        book: AppointmentBook,
        tenant: Owner | None,
        identity: int,
        rank: int = STANDARD_RANK,
    ) -> None:
        self.at = at  # when the client was told to come back (monotonic seconds, whole ms of its hint)
        self.rank = rank  # its client's standing (Ask.rank): it holds against that rank and those below
        self.amount = amount  # what it was promised: 1 slot, or its token cost
        self.book = book
        self.tenant = tenant
        self.identity = identity
        self.ticket = ""
        self.closes = 0.0  # the end of its window (`at` + half the grace)
        self.displaced = False  # booked for a displaced request (displacement.py): its return is never displaced
        self.in_lobby = False  # its holder came back and is held until its capacity frees (governor/lobby.py)
        self.last_call = False  # its holder, held, has reached its promise horizon: answer it now
        self.came_at = 0.0  # when its holder came back, if it was held
        self.booked_at = at  # when it was first booked (`refuse` sets it): moves keep it

    def opened(self, now: float) -> bool:
        """Whether its window has opened by `now`: `at` <= now + half the grace, the one test of
        it everywhere (the book bisects its times the same way), so that no float rounding makes
        a window open for the book and not for its holder."""
        return self.at <= now + self.book.registry.half_grace_s


class AppointmentBook:
    """One limit's appointments, sorted by time."""

    __slots__ = (
        "reason",
        "registry",
        "unit",
        "free_at",
        "entries",
        "times",
        "promised",
        "ranks",
        "mixed",
        "max_entries",
        "trust",
        "used",
        "probes",
        "_cumulative",
        "_ranked",
    )

    def __init__(
        self, reason: str, registry: Appointments, unit: bool, free_at: FreeAt, max_entries: int = 4096
    ) -> None:
        self.reason = reason
        self.registry = registry
        self.unit = unit  # every appointment is for 1 (a slot): what they hold is their count
        # When the requests in flight (and those of the first `ahead` appointments) will have
        # released `need`, for a client short of `deficit` (the release forecast).
        self.free_at = free_at
        self.entries: list[Appointment] = []
        self.times: list[float] = []  # each entry's `at`, in the same order: what forecasts read
        self.promised = 0.0  # the sum of the live appointments' amounts
        self.ranks = [0] * RANKS  # how many live appointments each rank holds (Ask.rank)
        self.mixed = 0  # how many of them are of another rank than standard (0: ranks play no part)
        self.max_entries = max_entries
        # Per rank, the recent share of its appointments their clients kept (came back for, in
        # time or not): below MIN_TRUST that rank's appointments keep nothing (`binding`). Per book
        # and rank, so that a flood of one class or one tenant that never comes back does not
        # unbind the promises made to the others.
        self.trust = [1.0] * RANKS
        self.used = [0] * RANKS  # how many appointments each rank ever booked here (for the gauge)
        self.probes = [0] * RANKS  # refusals of each rank while its trust was low (`_not_a_probe`)
        self._cumulative: list[float] | None = []  # running sums of the amounts; None = stale
        self._ranked = 0  # the standings the ranks were last re-evaluated for (`Appointments.standings`)
        registry.books.append(self)

    def cumulative(self) -> list[float]:
        """The running sums of the appointments' amounts, in the book's order (recomputed after
        the book changed: read only by the token budget's refusals)."""
        if self._cumulative is None:
            self._cumulative = list(accumulate(entry.amount for entry in self.entries))
        return self._cumulative

    def sweep(self, now: float) -> None:
        """Appointments whose window closed leave the book (lapsed: no-shows); one whose holder
        waits in the lobby stays until the lobby answers it (the no-shows after it lapse all the
        same: the book is in the order of the windows)."""
        entries = self.entries
        i = 0
        while i < len(entries) and entries[i].closes <= now:
            if entries[i].in_lobby:  # its holder is here: kept until answered
                i += 1
                continue
            lapsed = entries.pop(i)
            self._unrank(lapsed)
            self.registry.lapse(lapsed, now)
            del self.times[i]
            self._cumulative = None

    def held(self, now: float, appointment: Appointment | None, rank: int = STANDARD_RANK) -> float:
        """What the appointments whose window is open hold now from the asker (who came back with
        `appointment`, `Ask.appointment`, of standing `rank`): the sum of those of its rank and
        above — a slot promised to a sheddable client does not keep a critical frame out, nor one
        promised to a tenant over its fair share a tenant below it. A holder in its own window
        may take whatever is free but for what the appointments ranked above its own hold."""
        if not self.entries:
            return 0.0
        self.sweep(now)
        self.rerank()
        trust = self.trust
        if not self.mixed and trust[STANDARD_RANK] < MIN_TRUST:
            return 0.0  # (every appointment here is of the standard rank, and those keep nothing now)
        own = self.own(appointment)
        if own is not None and own.opened(now):
            rank = own.rank + 1
            if rank >= RANKS or not sum(self.ranks[rank:]):
                return 0.0  # nobody outranks it: it may take whatever the limit has free
        opened = bisect_right(self.times, now + self.registry.half_grace_s)  # whose window opened
        if not opened:
            return 0.0
        if ((rank != STANDARD_RANK or self.mixed) and sum(self.ranks[:rank])) or (
            self.mixed and any(n and t < MIN_TRUST for t, n in zip(trust, self.ranks, strict=True))
        ):  # some ranked below the asker, or a rank whose appointments here keep nothing
            return float(sum(e.amount for e in self.entries[:opened] if e.rank >= rank and trust[e.rank] >= MIN_TRUST))
        if self.unit:
            return float(opened)
        return self.cumulative()[opened - 1]

    def book(
        self, at: float, amount: float, tenant: Owner | None, identity: int, rank: int = STANDARD_RANK
    ) -> Appointment | None:
        """Promise `amount` at `at`; None when the book is full."""
        if len(self.entries) >= self.max_entries:
            return None
        appointment = Appointment(at, amount, self, tenant, identity, rank)
        self.used[rank] += 1
        self._insert(appointment)
        self.registry.issue(appointment)
        return appointment

    def move(self, appointment: Appointment, at: float) -> None:
        """Put a removed appointment back at a new time, with its ticket and identity."""
        appointment.at = at
        self._insert(appointment)
        self.registry.restore(appointment)

    def _insert(self, appointment: Appointment) -> None:
        appointment.closes = appointment.at + self.registry.half_grace_s
        index = bisect_right(self.times, appointment.at)
        self.times.insert(index, appointment.at)
        self.entries.insert(index, appointment)
        self.promised += appointment.amount
        self._rank(appointment)
        self._cumulative = None

    def remove(self, appointment: Appointment) -> None:
        index = self.entries.index(appointment)
        del self.entries[index], self.times[index]
        self.promised -= appointment.amount
        self._unrank(appointment)
        self._cumulative = None
        self.registry.forget(appointment)

    def _rank(self, appointment: Appointment) -> None:
        self.ranks[appointment.rank] += 1
        if appointment.rank != STANDARD_RANK:
            self.mixed += 1

    def _unrank(self, appointment: Appointment) -> None:
        self.ranks[appointment.rank] -= 1
        if appointment.rank != STANDARD_RANK:
            self.mixed -= 1

    def rerank(self) -> None:
        """Each appointment's rank as it stands now (`Appointments.standing`: its tenant may have
        gone over its fair share since it was booked, or come back under it), when the book is
        consulted after the tenants' standings changed (`Appointments.standings`). Ranks decide
        who is booked ahead and whose appointments keep capacity from whom: fixed at booking, a
        flood booked while at its share would keep a newcomer out long after it went over it."""
        registry = self.registry
        standing = registry.standing
        if standing is None or self._ranked == registry.standings or not self.entries:
            return
        self._ranked = registry.standings
        for entry in self.entries:
            rank = standing(entry)
            if rank != entry.rank:
                self._unrank(entry)
                entry.rank = rank
                self._rank(entry)

    def regrace(self) -> None:
        """The grace changed (reload): every window is re-cut around its appointment."""
        half = self.registry.half_grace_s
        for entry in self.entries:
            entry.closes = entry.at + half

    def own(self, appointment: Appointment | None) -> Appointment | None:
        """The asker's appointment (`Ask.appointment`) if it is one of this book's and still in it
        (a frame keeps the appointment it came with after the appointment left its book: redeemed,
        or booked anew by another limit; a re-route or a displacement decides it again)."""
        if appointment is None or appointment.book is not self:
            return None
        return appointment if self.registry.by_ticket.get(appointment.ticket) is appointment else None

    def redeem(self, appointment: Appointment | None, now: float) -> None:
        """The asker was admitted (`charge`): if it held one of this book's appointments, it was
        kept, on time, or early into capacity that was free anyway. How late after its
        appointment it came is learnt (`Appointments.round_delay_s`)."""
        own = self.own(appointment)
        if own is None:
            return
        registry = self.registry
        if own.opened(now):
            registry.count(self, own.rank, ON_TIME)
            late = (own.came_at if own.in_lobby else now) - own.at  # when it came, held or not
            registry.lateness_s += LATENESS_SMOOTHING * ((late if late > 0 else 0.0) - registry.lateness_s)
            # Held, it got its capacity when that freed; not held, the capacity was free already.
            registry.learn_release(now - own.at if own.in_lobby else 0.0)
        else:
            registry.count(self, own.rank, EARLY)
        self.remove(own)

    def _not_a_probe(self, rank: int) -> bool:
        """While a rank's appointments keep nothing (its trust is low), one refusal in
        `PROBE_EVERY` still books one (keeping nothing either: `held` skips the rank): the clients
        that come back for those are what brings trust back. Without them nothing would be booked,
        nobody could come back for anything, and the rank would stay unbound for good."""
        self.probes[rank] += 1
        return self.probes[rank] % PROBE_EVERY != 0

    def refused_elsewhere(self, own: Appointment) -> None:
        """Its holder came in its window but another limit refused it: the appointment goes back
        (its capacity is anyone's at once, not idle until the window closes) and the return is
        counted `refused_elsewhere`: it came, so it is no no-show's lapse against the book's trust."""
        self.registry.count(self, own.rank, REFUSED_ELSEWHERE)
        self.remove(own)

    def _take_over(self, held: Appointment | None, now: float) -> float:
        """Since when the refused client has waited on promises: `now`, or, when it holds another
        limit's live appointment (refused here now), that appointment's first refusal. One
        appointment per client: the other one goes (counted `refused_elsewhere` in its window),
        and a promise is made once: its horizon still counts from the first refusal."""
        if held is None or self.registry.by_ticket.get(held.ticket) is not held:
            return now
        if held.opened(now):
            self.registry.count(held.book, held.rank, REFUSED_ELSEWHERE)
        held.book.remove(held)
        return held.booked_at

    def refuse(
        self,
        now: float,
        held: Appointment | None,
        tenant: Owner | None,
        identity: int,
        deficit: float,
        amount: float,
        rank: int = STANDARD_RANK,
    ) -> tuple[int, Appointment | None]:
        """The hint (ms) and the appointment for a frame this limit cannot take now. `held`: the
        appointment the frame came back with (`Ask.appointment`), if any; `deficit`: how much must
        be released before it fits, not counting the appointments; `rank`: its standing (`Ask.rank`:
        a new appointment comes after those of its rank and above, before those of lower ranks)."""
        first = now  # when this client was first refused (its promise horizon counts from then)
        # Runs for every frame the limit refuses: the sweep's test, and `own` inlined.
        registry = self.registry
        free_at = self.free_at
        entries = self.entries
        if entries and entries[0].closes <= now:
            self.sweep(now)
        self.rerank()
        # (one that left this book already, redeemed or booked anew elsewhere, is no longer its own)
        own = held if held is not None and held.book is self and registry.by_ticket.get(held.ticket) is held else None
        if own is not None:
            if not own.opened(now):  # early: told the time left, keeps its place
                registry.count(self, own.rank, EARLY)
                return max(1, math.ceil((own.at - now) * 1000 - 1e-6)), own
            if registry.lobby:
                if not own.last_call:
                    # In its window and its capacity not free yet: held in the lobby until it frees
                    # (the capacity is kept for this holder) or its promise horizon is reached.
                    return HOLD, own
                # Held to the horizon and still no room: the promise is not renewed, it is refused
                # for good (a client waits on promises at most the horizon).
                own.last_call = False
                registry.count(self, own.rank, YIELDED_AGAIN)
                registry.learn_release(now - own.at)  # at least this late: it has not freed yet
                self.remove(own)
                return max(math.ceil(registry.hints.policy.horizon_ms), 1), None
            # In its window and still no room (the forecast was early): it keeps its place in the
            # book, before every appointment made after it, and its ticket.
            registry.count(self, own.rank, YIELDED_AGAIN)
            ahead = self.entries.index(own)
            need = deficit + (self.cumulative()[ahead] - own.amount if ahead else 0.0)
            self.remove(own)
        elif self.trust[rank] < MIN_TRUST and self._not_a_probe(rank):  # that rank's keep nothing now
            # Most appointments lapse unkept (a flood that never comes back): no promise, no
            # booking, the forecast of the release this frame needs ahead of no one.
            release = free_at(now, deficit if deficit > 1.0 else 1.0, deficit, 0)
            if release is None:
                return registry.hints.hint_ms(now), None
            return registry.hints.jittered_ms((release - now) * 1000.0), None
        else:
            first = self._take_over(held, now)
            times = self.times
            ahead = len(times)
            need = deficit + self.promised
            if (rank != STANDARD_RANK or self.mixed) and sum(self.ranks[:rank]):  # lower ranks do not go first
                ahead = sum(self.ranks[rank:])
                need = deficit + sum(e.amount for e in entries if e.rank >= rank)
            elif times and (times[-1] - now + registry.hints.gap_s) * 1000.0 >= registry.hints.policy.horizon_ms:
                # Its turn comes after every appointment made, about a release later, past the
                # horizon: a flood is refused for good at the cost of one comparison.
                return math.ceil(registry.hints.policy.horizon_ms), None
        release = free_at(now, need if need > 1.0 else 1.0, deficit, ahead)
        hints = registry.hints
        if release is None:  # nothing in flight to forecast from
            return hints.hint_ms(now), None
        # "Be here by": the forecast release, earlier by what holders are late on average, so that
        # the slot's holder is there (held in the lobby) when it frees, not after it idled.
        at = release - registry.early_s if registry.lobby else release
        if own is not None and at < now + registry.half_grace_s:
            # Its slot is late: its new window opens now, so the slot is kept for it the moment it
            # frees, and it comes back half a window later.
            at = now + registry.half_grace_s
        wait_ms = (at - now) * 1000.0
        policy = hints.policy
        # In whole milliseconds, rounded up; the appointment is what the client will compute from
        # it, to the microsecond, so that nobody is told a time before the one kept for it.
        hint_ms = math.ceil(wait_ms - 1e-6)
        if hint_ms < policy.min_ms:
            hint_ms = math.ceil(policy.min_ms)
        # Past the horizon, counting what releases have recently come after their time told (a
        # server whose prefills stall its batch ends requests later than their pace says): no
        # promise that would be kept soon. The hint as told is what is promised: a wait a
        # fraction of a millisecond inside the horizon, rounded up to it, is past it.
        if _reaches(hint_ms + (now - first + registry.release_lateness_s) * 1000.0, policy.horizon_ms):
            return math.ceil(max(policy.horizon_ms, min(wait_ms, policy.max_ms))), None  # final
        at = now + hint_ms / 1000.0
        if own is not None:
            self.move(own, at)
            return hint_ms, own
        appointment = self.book(at, amount, tenant, identity, rank)
        if appointment is not None:
            appointment.booked_at = first
        return hint_ms, appointment


class PrepaidBook(AppointmentBook):
    """The appointments of a rate cap: a token bucket (`qps`, `token_rate`, an endpoint's `qps=`,
    a tenant's `max_qps` and `max_tokens_per_s`). A bucket refills exactly, so its promise is kept
    by paying for it at once: the refusal takes what its client will need from the bucket now
    (into debt if it must), and the appointment is when that debt is paid back. Whoever comes
    after finds the bucket lower by it and is told a later time, so nobody can take the tokens
    promised, and the holder that comes from its time to the end of its window is let in without
    paying again (`prepaid`). What was paid is spent, whatever becomes of it: a no-show's tokens,
    or those of a holder another limit refuses, never go back to the bucket, because the
    appointments booked after it were told times that count them taken (giving them back would
    let newcomers in ahead of those, past the rate). A no-show thus wastes its tokens, as a
    capacity book's no-show idles its slot for a window; a flood that never comes back stops being
    booked (`trust`), and its probes pay nothing. A window keeps nothing from anyone (what was
    promised is out of the bucket already), so no holder waits in the lobby for it."""

    __slots__ = ("bucket",)

    def __init__(
        self, reason: str, registry: Appointments, unit: bool, bucket: Callable[[], TokenBucket | None]
    ) -> None:
        super().__init__(reason, registry, unit, _no_forecast)
        self.bucket = bucket  # the limit's bucket now (a reload replaces it, keeping its level)
        # A rate's promise costs its tokens when nobody comes for it (a slot's, only a window), so
        # a rate book starts on probation, at the threshold: it pays for its refusals until the
        # first one lapses unkept, and again once a client has come back. A flood of clients
        # that never retry thus costs the tokens booked before its first no-show, not those of
        # the dozen no-shows a trusted book would take to stop paying.
        self.trust = [MIN_TRUST] * RANKS

    def credit(self, now: float, appointment: Appointment | None) -> float | None:
        """What the asker's appointment here paid for it, once its time has come (0.0 for one
        without an appointment here); None before its time: it is told the time left."""
        own = self.own(appointment)
        if own is None:
            return 0.0
        return own.amount if own.at <= now else None

    def pay(self, appointment: Appointment | None, now: float, amount: float) -> float:
        """The asker, taking `amount`, was admitted: what is left for the bucket to take (what its
        appointment here did not pay for already, which is redeemed)."""
        own = self.own(appointment)
        if own is None:
            return amount
        self.redeem(own, now)
        return max(0.0, amount - own.amount)

    def rebucket(self) -> None:
        """Its limit's bucket was replaced (a reload). Gone (the rate switched off), the tokens
        the appointments paid went with it: they keep nothing any more, and their holders come
        back as new clients. (A bucket kept keeps its debt: updated_bucket.)"""
        if self.bucket() is None:
            for entry in list(self.entries):
                self.remove(entry)

    def refuse(
        self,
        now: float,
        held: Appointment | None,
        tenant: Owner | None,
        identity: int,
        deficit: float,
        amount: float,
        rank: int = STANDARD_RANK,
    ) -> tuple[int, Appointment | None]:
        """The hint (ms) and the appointment for a frame the bucket cannot take now: `deficit` is
        what it lacks (its `amount` and what its class's ceiling keeps in the bucket, less the
        level and what its appointment here paid). Past the promise horizon, final and unpaid;
        while `rank`'s appointments here are not kept (`trust`), the exact wait, unpaid."""
        registry = self.registry
        entries = self.entries
        if entries and entries[0].closes <= now:
            self.sweep(now)
        first = now  # when this client was first refused (its promise horizon counts from then)
        paid = 0.0  # what its appointment here paid already (it asks for more: booked for the rest)
        own = self.own(held)
        if own is not None:
            if own.at > now:  # before its time (from then on it is let in): the time left, its place kept
                registry.count(self, own.rank, EARLY)
                return max(1, math.ceil((own.at - now) * 1000 - 1e-6)), own
            # In its time, asking for more than it paid for: booked anew for the rest (its promise
            # still counts from its first refusal).
            registry.count(self, own.rank, YIELDED_AGAIN)
            self.remove(own)
            paid, first = own.amount, own.booked_at
        bucket = self.bucket()
        assert bucket is not None  # (the limit refuses only through a bucket)
        wait_ms = deficit / bucket.rate * 1000.0
        if self.trust[rank] < MIN_TRUST:
            if self._not_a_probe(rank):
                return max(1, math.ceil(wait_ms - 1e-6)), None
            # A probe pays nothing: its client's return is counted (and brings trust back), but
            # it takes its tokens like anyone, so the probes of a flood that never comes back
            # cost no tokens.
            amount = paid
        if own is None:
            first = self._take_over(held, now)
        policy = registry.hints.policy
        hint_ms = max(1, math.ceil(wait_ms - 1e-6), math.ceil(policy.min_ms))
        # Its appointment is when its tokens are there (or its hint, if that is sooner: within a
        # microsecond's rounding), so that the holder coming back at its hint is let in.
        wait_s = min(max(wait_ms, policy.min_ms) / 1000.0, hint_ms / 1000.0)
        if _reaches(wait_s * 1000.0 + (now - first) * 1000.0, policy.horizon_ms):  # what would be promised
            # Final; the exact wait, for information (a bucket's refill is no forecast to clamp).
            return math.ceil(max(policy.horizon_ms, wait_ms - 1e-6)), None
        appointment = self.book(now + wait_s, amount, tenant, identity, rank)
        if appointment is not None:
            appointment.booked_at = first
            bucket.take(amount - paid)
        return hint_ms, appointment


def _reaches(promise_ms: float, horizon_ms: float) -> bool:
    """Whether a promise this long after its client's first refusal is at or past the horizon;
    within a nanosecond of it counts as at it, since the clock's float sums may land either side."""
    return promise_ms >= horizon_ms - 1e-6


def _no_forecast(at: float, need: float, deficit: float, ahead: int) -> float | None:
    """A prepaid book's `free_at`: never asked (its refusals compute the bucket's exact time)."""
    return None


def identity_of(tenant: Owner | None, resent: object) -> int:
    """What recognises a client re-sending a refused request without its ticket (`Ask.identity`):
    its tenant (the object, one per name while the tenant is configured) and what it re-sends (a door's
    choice: an NDJSON id and prompt, an HTTP body). Python's hash is keyed per process (SipHash):
    nobody outside can make another request's identity. Never 0 (0 is no identity)."""
    return hash((tenant, resent)) or 1


FreeAt = Callable[[float, float, float, int], "float | None"]
"""When the requests in flight (and those of the first `ahead` appointments) will have released
`need`, for a client short of `deficit` (release_forecast.py); None when nothing can be forecast."""

NewBook = Callable[[str, object], "AppointmentBook"]
"""Makes the book of one tenant's or one endpoint's own cap (its reason, the tenant or endpoint):
the limit makes it on its first refusal there."""


class Tickets:
    """Random tickets, 96 bits each, unguessable (os.urandom), drawn 256 at a time: one system
    call per 256 refusals rather than one per refusal."""

    __slots__ = ("_pool", "_next")

    SIZE = 12
    BATCH = 256

    def __init__(self) -> None:
        self._pool = b""
        self._next = 0

    def __call__(self) -> str:
        start = self._next
        if start >= len(self._pool):
            self._pool, start = os.urandom(self.SIZE * self.BATCH), 0
        self._next = start + self.SIZE
        return self._pool[start : start + self.SIZE].hex()


class Lapsed:
    """An appointment whose window closed unredeemed, remembered for a late return."""

    __slots__ = ("at", "book", "rank", "tenant", "keys")

    def __init__(
        self, at: float, book: AppointmentBook, rank: int, tenant: Owner | None, keys: tuple[object, ...]
    ) -> None:
        self.at = at  # when its window closed
        self.book = book
        self.rank = rank
        self.tenant = tenant
        self.keys = keys  # its ticket, and its identity if it had one


class Appointments:
    """Every book's appointments by ticket and by identity, and the outcome counts."""

    __slots__ = (
        "half_grace_s",
        "lateness_s",
        "release_lateness_s",
        "hints",
        "books",
        "by_ticket",
        "by_identity",
        "lapsed",
        "outcomes",
        "_new_ticket",
        "lobby",
        "reasons",
        "standing",
        "standings",
    )

    def __init__(
        self,
        grace_s: float,
        hints: RetryHintEstimator,
        new_ticket: Callable[[], str] | None = None,
    ) -> None:
        self.half_grace_s = grace_s / 2
        # How long after its appointment a holder comes, on average (its timers, its network).
        self.lateness_s = 0.0
        # How long after the time told the capacity promised comes free, on average (releases
        # later than forecast: a server whose prefills stall its batch). Learnt from the holders
        # held for it; whether a promise fits the horizon counts it.
        self.release_lateness_s = 0.0
        self.hints = hints  # the clamps, and the hint when nothing can be forecast
        self.books: list[AppointmentBook] = []
        # The limits that book appointments (none with --retry-hint fixed): reported from the start.
        self.reasons: tuple[str, ...] = ()
        self.by_ticket: dict[str, Appointment] = {}
        # By identity, the appointments of the clients sending that request, in booking order.
        self.by_identity: dict[int, list[Appointment]] = {}
        self.lapsed: dict[object, Lapsed] = {}  # by ticket and by identity, oldest first
        self.outcomes: dict[tuple[str, str], int] = {}
        self._new_ticket = new_ticket or Tickets()
        # Whether a holder that comes in its window before its capacity frees is held (a door
        # with a lobby, governor/lobby.py) rather than told the next release at once.
        self.lobby = False
        # An appointment's rank now (its class, then whether its tenant is over its fair share),
        # while tenants share capacity (admission sets it); None: ranks stay as booked.
        self.standing: Callable[[Appointment], int] | None = None
        # Counts the changes of the tenants' standings (who is over its share): a book re-ranks
        # its appointments when consulted after one, not on every frame.
        self.standings = 0

    @property
    def round_delay_s(self) -> float:
        """How long after its appointment a holder's request starts: its learnt lateness and a
        millisecond of margin. An appointment's slot is free again a service time after that.
        Erring late is safe (the slot is kept for its holder through the window); early is not."""
        return self.lateness_s + HINT_RESOLUTION_S

    def learn_release(self, late_s: float) -> None:
        """A holder's capacity came free `late_s` after its appointment (0: it was free when the
        holder came)."""
        late_s = min(max(late_s, 0.0), self.hints.policy.horizon_ms / 1000.0)
        self.release_lateness_s += LATENESS_SMOOTHING * (late_s - self.release_lateness_s)

    @property
    def early_s(self) -> float:
        """How much before its release a holder is told to come (with the lobby): its learnt
        lateness and a millisecond, at most half the window. Clients refused together need no
        jitter: those that come together are held and let in one release at a time."""
        early = self.lateness_s + HINT_RESOLUTION_S
        return early if early < self.half_grace_s else self.half_grace_s

    def set_grace(self, grace_s: float) -> None:
        """Live change (reload): the windows of the appointments booked are re-cut too."""
        self.half_grace_s = grace_s / 2
        for book in self.books:
            book.regrace()

    def open_by_reason(self) -> dict[str, int]:
        """The appointments booked and not yet redeemed, by the limit that booked them (`reasons`,
        each from the start; the books of a limit: one per tenant or endpoint for their own caps)."""
        counts = dict.fromkeys(self.reasons, 0)
        for book in self.books:
            if book.reason in counts:
                counts[book.reason] += len(book.entries)
        return counts

    def count(self, book: AppointmentBook, rank: int, outcome: str) -> None:
        """A return to an appointment of `book` and `rank` (or its never coming back), counted."""
        key = (book.reason, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if outcome != NEVER:  # a client came back for it: the appointments are worth keeping
            trust = book.trust
            trust[rank] += TRUST_WEIGHT * (1.0 - trust[rank])

    def trust_by_reason(self) -> dict[str, float]:
        """The lowest share kept among the books of each limit and the ranks they booked for (what
        `governor_appointments_trust` shows: below one half, those appointments keep nothing)."""
        lowest = dict.fromkeys(self.reasons, 1.0)
        for book in self.books:
            used = [t for t, n in zip(book.trust, book.used, strict=True) if n]
            if used and book.reason in lowest:
                lowest[book.reason] = min(lowest[book.reason], *used)
        return lowest

    def issue(self, appointment: Appointment) -> None:
        ticket = appointment.ticket = self._new_ticket()
        self.by_ticket[ticket] = appointment
        if appointment.identity:
            self.by_identity.setdefault(appointment.identity, []).append(appointment)

    def identify(self, appointment: Appointment, identity: int) -> None:
        """The door recognises a client's returns by `identity` (what it re-sends)."""
        if identity and not appointment.identity:
            appointment.identity = identity
            self.by_identity.setdefault(identity, []).append(appointment)

    def restore(self, appointment: Appointment) -> None:
        """A moved appointment is found by its ticket and identity again."""
        self.by_ticket[appointment.ticket] = appointment
        if appointment.identity:
            self.by_identity.setdefault(appointment.identity, []).append(appointment)

    def forget(self, appointment: Appointment) -> None:
        self.by_ticket.pop(appointment.ticket, None)
        same = self.by_identity.get(appointment.identity)
        if same is not None:
            if appointment in same:
                same.remove(appointment)
            if not same:
                del self.by_identity[appointment.identity]

    def lapse(self, appointment: Appointment, now: float) -> None:
        """Its window closed without it: out of its book; remembered a while for a late return."""
        book = appointment.book
        book.trust[appointment.rank] -= TRUST_WEIGHT * book.trust[appointment.rank]
        book.promised -= appointment.amount
        self.forget(appointment)
        keys: tuple[object, ...] = (
            (appointment.ticket, appointment.identity) if appointment.identity else (appointment.ticket,)
        )
        record = Lapsed(appointment.closes, appointment.book, appointment.rank, appointment.tenant, keys)
        for key in keys:
            self.lapsed[key] = record
        self.age(now)

    def tidy(self, now: float) -> None:
        """Before a report: every book's closed windows lapse (a book is swept by its own limit's
        refusals: a tenant gone quiet, or whose cap a reload removed, would keep them), then the
        lapsed past memory count as never back."""
        for book in self.books:
            entries = book.entries
            if entries and entries[0].closes <= now:
                book.sweep(now)
        self.age(now)

    def age(self, now: float) -> None:
        """Forget the lapsed appointments past memory (or past the bound), oldest first: they
        never came back. Run on each frame while any is remembered, and before each report."""
        lapsed = self.lapsed
        while lapsed:
            oldest = lapsed[next(iter(lapsed))]
            if now - oldest.at < LAPSED_MEMORY_S and len(lapsed) < 65536:
                return
            self._drop(oldest)
            self.count(oldest.book, oldest.rank, NEVER)

    def _drop(self, record: Lapsed) -> None:
        for key in record.keys:
            if self.lapsed.get(key) is record:
                del self.lapsed[key]

    def find(
        self, ticket: str | None, identity: int, unique: bool, tenant: Owner | None, now: float
    ) -> Appointment | None:
        """The live appointment this frame holds, or None: its ticket's (any time before its
        window closes), else the earliest one of its identity whose window is open, or, for an
        identity only one client can send (`unique`: it names the client's request id), its one
        appointment whenever it comes. A late return is counted here."""
        if self.lapsed:
            self.age(now)
        if ticket is not None:
            appointment = self.by_ticket.get(ticket)
            if appointment is not None and appointment.tenant is tenant:  # another tenant's: no ticket
                if appointment.in_lobby:
                    return None  # its holder is here already: a second frame for it is a new client
                if appointment.closes > now:
                    return appointment
                appointment.book.sweep(now)  # its window closed and nobody swept it yet: lapse it
        if identity:
            for appointment in self.by_identity.get(identity, ()):
                # (one held in the lobby has its client: the next one of that identity is this one's)
                if appointment.tenant is tenant and not appointment.in_lobby and (unique or appointment.opened(now)):
                    if appointment.closes > now:
                        return appointment
                    appointment.book.sweep(now)
                    break
        for key in (ticket, identity):
            record = self.lapsed.get(key) if key else None
            if record is not None and record.tenant is tenant:
                self._drop(record)
                self.count(record.book, record.rank, LATE)
                break
        return None
