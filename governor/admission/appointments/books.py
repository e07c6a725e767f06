"""The books: each limit that promises keeps its appointments in one, sorted by time.

A capacity book (`AppointmentBook`: the in-flight cap, the token budget, the endpoint caps, a
tenant's own in-flight and token caps) promises the next release nobody was promised yet (the
release forecast, release_forecast.py) and keeps it through the appointment's window: the limit
counts what the open windows hold as taken (`held`). A rate book (`PrepaidBook`: a token bucket)
keeps its promise by paying for it at once. Both answer a refusal the same way (`refuse`): a
holder back early is told the time left and keeps its place; otherwise the book promises what it
can (`_promise`: each kind's own), unless the promise would reach past the horizon, when the
refusal is final and books nothing. The appointment's own phases are appointment.py's.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING

from governor.admission.appointments.appointment import Appointment, Asker, Phase
from governor.admission.appointments.registry import (
    EARLY,
    LATE,
    LATENESS_SMOOTHING,
    ON_TIME,
    REFUSED_ELSEWHERE,
    YIELDED_AGAIN,
)
from governor.admission.priority import RANKS, STANDARD_RANK

if TYPE_CHECKING:
    from governor.admission.appointments.registry import Appointments
    from governor.admission.buckets import TokenBucket

HOLD = 0
"""The hint of a refusal that is no answer yet (limits.Refusal): its holder came back in its window
before its capacity freed and waits in the lobby. Never a real hint, which is >= 1."""

PROBE_EVERY = 8
"""While a book's rank keeps nothing, one refusal in this many books an appointment all the same:
a probe whose client's return brings trust back."""

MIN_TRUST = 0.5
"""Below this share of a book's appointments of one rank kept, those stop keeping capacity: a
flood of clients that never come back would otherwise hold every slot it was promised, one window
after another, for the whole horizon it booked, while the capacity idles. Their hints then are the
plain forecast; keeping resumes as clients come back (`AppointmentBook.trust`)."""

FreeAt = Callable[[float, float, float, int], "float | None"]
"""When the requests in flight (and those of the first `ahead` appointments) will have released
`need`, for a client short of `deficit` (release_forecast.py); None when nothing can be forecast."""

NewBook = Callable[[str, object], "AppointmentBook"]
"""Makes the book of one tenant's or one endpoint's own cap (its reason, the tenant or endpoint):
the limit makes it on its first refusal there."""

Answer = tuple[int, Appointment | None]
"""A refusal's hint (ms) and the appointment kept for it, if one was."""


class AppointmentBook:
    """One capacity limit's appointments, sorted by time."""

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

    reranks = True
    """Whether its refusals read the ranks as they stand now (a capacity book's do: ranks decide
    who goes ahead; a rate book's promises are paid for already)."""

    keeps_late = True
    """Whether a holder back a little after its window closed is still owed its promise
    (registry.Appointments._late): a capacity book's lapse gave its capacity back, which the
    holder takes again; a rate book's lapse spent what it paid, and a late holder pays anew."""

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

    @property
    def half_grace_s(self) -> float:
        """Half the grace: a window opens this long before its appointment and closes this long after."""
        return self.registry.half_grace_s

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
            lapsed.lapse()
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

    def due(self, now: float, appointment: Appointment | None, rank: int, free: int) -> float:
        """When the `free` units free now are all wanted (a slot book's): the time of the `free`-th
        appointment, in the book's order, among those that hold from the asker (`held`'s rule:
        window open, of its rank and above, of a rank whose appointments keep capacity). A unit
        lent now and given back by then breaks no promise (a backfill: limits.InflightLimiter);
        math.inf when fewer hold."""
        if free <= 0:
            return now
        own = self.own(appointment)
        if own is not None and own.opened(now):
            rank = own.rank + 1
        opened = bisect_right(self.times, now + self.registry.half_grace_s)
        trust = self.trust
        for entry in self.entries[:opened]:
            if entry.rank >= rank and trust[entry.rank] >= MIN_TRUST and entry is not own:
                free -= 1
                if not free:
                    return entry.at
        return math.inf

    def book(self, at: float, ask: Asker, amount: float, first: float, displaced: bool) -> Appointment | None:
        """Promise `amount` at `at` to the client of `ask`, first refused at `first`; None when the
        book is full."""
        if len(self.entries) >= self.max_entries:
            return None
        appointment = Appointment(at, amount, self, ask.tenant, ask.identity, ask.rank, displaced)
        appointment.booked_at = first
        self.used[ask.rank] += 1
        self._insert(appointment)
        self.registry.issue(appointment)
        return appointment

    def move(self, appointment: Appointment, at: float) -> None:
        """Put a removed appointment back at a new time, with its ticket and identity."""
        appointment.rebook(at)
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

    def remove(self, appointment: Appointment, redeemed: bool = False) -> None:
        """Out of the book: its holder was admitted (`redeemed`), or it is given back."""
        index = self.entries.index(appointment)
        del self.entries[index], self.times[index]
        if redeemed:
            appointment.redeem()
        else:
            appointment.give_back()
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
        if appointment is None or appointment.book is not self or not appointment.live:
            return None
        return appointment

    def redeem(self, appointment: Appointment | None, now: float) -> None:
        """The asker was admitted (`charge`): if it held one of this book's appointments, it was
        kept, on time, or early into capacity that was free anyway. How late after its
        appointment it came is learnt (`Appointments.round_delay_s`)."""
        own = self.own(appointment)
        if own is None:
            return
        registry = self.registry
        if own.late:  # back after its window closed, kept all the same (registry.find): no lateness to learn
            registry.count(self, own.rank, LATE)
        elif own.opened(now):
            registry.count(self, own.rank, ON_TIME)
            late = (own.came_at if own.in_lobby else now) - own.at  # when it came, held or not
            registry.lateness_s += LATENESS_SMOOTHING * ((late if late > 0 else 0.0) - registry.lateness_s)
            # Held, it got its capacity when that freed; not held, the capacity was free already.
            registry.learn_release(now - own.due if own.in_lobby else 0.0)
        else:
            registry.count(self, own.rank, EARLY)
        self.remove(own, redeemed=True)

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
        if held is None or not held.live:
            return now
        if held.opened(now):
            self.registry.count(held.book, held.rank, REFUSED_ELSEWHERE)
        held.book.remove(held)
        return held.booked_at

    # -- refusing ---------------------------------------------------------------------------------

    def refuse(self, now: float, ask: Asker, deficit: float, amount: float, displaced: bool = False) -> Answer:
        """The hint (ms) and the appointment for the frame of `ask` that this limit cannot take
        now: `deficit` is how much must be released before it fits, not counting the
        appointments, `amount` what it would take; its standing (`Ask.rank`) puts a new
        appointment after those of its rank and above, before those of lower ranks; `displaced`:
        a displaced request's, never displaced again (it comes with no appointment of its own). A
        holder back before its window is told the time left and keeps its place; anything else
        is the book's promise (`_promise`, each kind's own). Runs for every frame the limit
        refuses: the sweep's test and `own` inlined."""
        entries = self.entries
        if entries and entries[0].closes <= now:
            self.sweep(now)
        if self.reranks:
            self.rerank()
        held = None if displaced else ask.appointment
        own = held if held is not None and held.book is self and held.live else None
        if own is not None and self._before_window(own, now):
            self.registry.count(self, own.rank, EARLY)
            return max(1, math.ceil((own.at - now) * 1000 - 1e-6)), own
        return self._promise(now, own, held, ask, deficit, amount, displaced)

    def _before_window(self, own: Appointment, now: float) -> bool:
        return not own.opened(now)

    def _promise(
        self,
        now: float,
        own: Appointment | None,
        held: Appointment | None,
        ask: Asker,
        deficit: float,
        amount: float,
        displaced: bool,
    ) -> Answer:
        """A capacity book's promise: the next release nobody was promised, kept through its window."""
        registry = self.registry
        first = now  # when this client was first refused (its promise horizon counts from then)
        rank = ask.rank
        if own is not None:  # in its window and its capacity not free yet
            if registry.lobby:
                return self._hold_or_end(now, own)
            # Without a lobby it keeps its place in the book, before every appointment made after
            # it, and its ticket (the forecast was early).
            registry.count(self, own.rank, YIELDED_AGAIN)
            ahead = self.entries.index(own)
            need = deficit + (self.cumulative()[ahead] - own.amount if ahead else 0.0)
            self.remove(own)
        elif self.trust[rank] < MIN_TRUST and self._not_a_probe(rank):  # that rank's keep nothing now
            return self._unbound(now, deficit)
        else:
            first = self._take_over(held, now)
            times = self.times
            ahead = len(times)
            need = deficit + self.promised
            if (rank != STANDARD_RANK or self.mixed) and sum(self.ranks[:rank]):  # lower ranks do not go first
                ahead = sum(self.ranks[rank:])
                need = deficit + sum(e.amount for e in self.entries if e.rank >= rank)
            elif times and (times[-1] - now + registry.hints.gap_s) * 1000.0 >= registry.hints.policy.horizon_ms:
                # Its turn comes after every appointment made, about a release later, past the
                # horizon: a flood is refused for good at the cost of one comparison.
                return math.ceil(registry.hints.policy.horizon_ms), None
        release = self.free_at(now, need if need > 1.0 else 1.0, deficit, ahead)
        if release is None:  # nothing in flight to forecast from
            return registry.hints.hint_ms(now), None
        # "Be here by": the forecast release, earlier by what holders are late on average, so that
        # the slot's holder is there (held in the lobby) when it frees, not after it idled.
        at = release - registry.early_s if registry.lobby else release
        if own is not None and at < now + registry.half_grace_s:
            # Its slot is late: its new window opens now, so the slot is kept for it the moment it
            # frees, and it comes back half a window later.
            at = now + registry.half_grace_s
        return self._told(now, at, first, own, ask, amount, displaced)

    def _hold_or_end(self, now: float, own: Appointment) -> Answer:
        """A holder in its window, its capacity not free yet, with a lobby: held until it frees
        (the capacity is kept for it) or its promise horizon is reached; held to the horizon and
        still no room, the promise is not renewed: refused for good (a client waits on promises
        at most the horizon)."""
        registry = self.registry
        if not own.last_call:
            return HOLD, own
        registry.count(self, own.rank, YIELDED_AGAIN)
        registry.learn_release(now - own.due)  # at least this late: it has not freed yet
        self.remove(own)
        return max(math.ceil(registry.hints.policy.horizon_ms), 1), None

    def _unbound(self, now: float, deficit: float) -> Answer:
        """Most appointments of this rank lapse unkept (a flood that never comes back): no promise,
        no booking, the forecast of the release this frame needs ahead of no one."""
        hints = self.registry.hints
        release = self.free_at(now, deficit if deficit > 1.0 else 1.0, deficit, 0)
        if release is None:
            return hints.hint_ms(now), None
        return hints.jittered_ms((release - now) * 1000.0), None

    def _told(
        self, now: float, at: float, first: float, own: Appointment | None, ask: Asker, amount: float, displaced: bool
    ) -> Answer:
        """The hint for a release at `at`, and the appointment kept for it; final (no appointment)
        when the promise would reach past the horizon from the client's first refusal."""
        registry = self.registry
        policy = registry.hints.policy
        wait_ms = (at - now) * 1000.0
        # In whole milliseconds, rounded up; the appointment is what the client will compute from
        # it, to the microsecond, so that nobody is told a time before the one kept for it.
        hint_ms = math.ceil(wait_ms - 1e-6)
        if hint_ms < policy.min_ms:
            hint_ms = math.ceil(policy.min_ms)
        # Past the horizon, counting how late releases have recently come after their time told
        # (a server whose prefills stall its batch ends requests later than their pace says): no
        # promise that would be kept soon. The hint as told is what is promised: a wait a
        # fraction of a millisecond inside the horizon, rounded up to it, is past it. While the
        # forecast is optimistic on lengths (few requests ended), the wait is judged stretched to
        # the conservative ones: told early, its holder is held in the lobby for the difference.
        stretch = registry.stretch()
        promised_ms = hint_ms * stretch
        if reaches(promised_ms + (now - first + registry.release_lateness_s) * 1000.0, policy.horizon_ms):
            return math.ceil(max(policy.horizon_ms, min(wait_ms * stretch, policy.max_ms))), None  # final
        at = now + hint_ms / 1000.0
        appointment = own
        if appointment is not None:
            self.move(appointment, at)
        else:
            appointment = self.book(at, ask, amount, first, displaced)
            if appointment is None:
                return hint_ms, None
        appointment.due = now + promised_ms / 1000.0
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

    reranks = False
    keeps_late = False

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

    def _before_window(self, own: Appointment, now: float) -> bool:
        return own.at > now  # from its time on it is let in

    def _promise(
        self,
        now: float,
        own: Appointment | None,
        held: Appointment | None,
        ask: Asker,
        deficit: float,
        amount: float,
        displaced: bool,
    ) -> Answer:
        """A rate book's promise: `deficit` is what the bucket lacks (its amount and what its
        class's ceiling keeps in the bucket, less the level and what its appointment here paid).
        Past the promise horizon, final and unpaid; while its rank's appointments here are not
        kept (`trust`), the exact wait, unpaid."""
        registry = self.registry
        first = now  # when this client was first refused (its promise horizon counts from then)
        paid = 0.0  # what its appointment here paid already (it asks for more: booked for the rest)
        if own is not None:
            # In its time, asking for more than it paid for: booked anew for the rest (its promise
            # still counts from its first refusal).
            registry.count(self, own.rank, YIELDED_AGAIN)
            self.remove(own)
            paid, first = own.amount, own.booked_at
        bucket = self.bucket()
        assert bucket is not None  # (the limit refuses only through a bucket)
        wait_ms = deficit / bucket.rate * 1000.0
        if self.trust[ask.rank] < MIN_TRUST:
            if self._not_a_probe(ask.rank):
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
        if reaches(wait_s * 1000.0 + (now - first) * 1000.0, policy.horizon_ms):  # what would be promised
            # Final; the exact wait, for information (a bucket's refill is no forecast to clamp).
            return math.ceil(max(policy.horizon_ms, wait_ms - 1e-6)), None
        appointment = self.book(now + wait_s, ask, amount, first, displaced)
        if appointment is not None:
            bucket.take(amount - paid)
        return hint_ms, appointment


def reaches(promise_ms: float, horizon_ms: float) -> bool:
    """Whether a promise this long after its client's first refusal is at or past the horizon;
    within a nanosecond of it counts as at it, since the clock's float sums may land either side."""
    return promise_ms >= horizon_ms - 1e-6


def _no_forecast(at: float, need: float, deficit: float, ahead: int) -> float | None:
    """A prepaid book's `free_at`: never asked (its refusals compute the bucket's exact time)."""
    return None


__all__ = ["HOLD", "AppointmentBook", "FreeAt", "NewBook", "Phase", "PrepaidBook"]
