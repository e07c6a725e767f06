"""The registry: every book's appointments by ticket and by identity, the lapsed ones remembered
for a late return, what the holders teach (how late they come, how late releases come), and the
outcome of every return.

The holder is recognised two ways (`Appointments.find`):
- by its ticket, the `retry_ticket` its yield carried and the retry sends back: random, unguessable,
  single use, valid only for the tenant it was issued to;
- by what it re-sends, for clients that know nothing of tickets: the same tenant re-sending the
  same request (`identity_of` over `Ask.resent`, the door's choice). An NDJSON frame's id and
  prompt name one client's request: re-sent, it is that client, whenever it comes. An HTTP body
  may come from several clients (a load generator's fixed prompt): each refused one gets an
  appointment of its own, and a frame is taken for the holder of the earliest one whose window
  is open; before its window nothing tells a holder coming back early from another client, so
  without a ticket it is a new client.

Anything else (unknown, forged, expired, reused or another tenant's ticket) is no ticket: never an
error and never a slot. Every return is counted by outcome (`OUTCOMES`): the only way to know in
production whether the hints hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from governor.admission.appointments.appointment import Appointment, Book, Owner

if TYPE_CHECKING:
    from governor.admission.hints import RetryHintEstimator

ON_TIME, EARLY, LATE, YIELDED_AGAIN, NEVER = "on_time", "early", "late", "yielded_again", "never"
REFUSED_ELSEWHERE = "refused_elsewhere"
OUTCOMES = (ON_TIME, EARLY, LATE, YIELDED_AGAIN, REFUSED_ELSEWHERE, NEVER)
"""What became of a retry hint: the holder came in its window and was admitted; came before it;
came after it (and was treated as a new client); came in it but the capacity was still taken;
came in it but another limit refused it (its appointment went back: not the forecast's fault); or
never came back (counted when its appointment lapses out of memory)."""

LATENESS_SMOOTHING = 0.1
"""EWMA weight of the newest delay between an appointment and its holder's admission, and of the
newest delay of a release after its time told."""

HINT_RESOLUTION_S = 0.001

TRUST_WEIGHT = 0.05
"""EWMA weight of the newest appointment's fate (kept by its client: 1; lapsed: 0) in the trust."""

LATE_KEPT_S = 0.25
"""A holder back this long after its window closed (and inside its promise horizon) is kept, not
taken for a new client: an SDK's timer among dozens of clients on a busy machine fires tens of
milliseconds late, past a 50 ms window's close (13 of 37 returns in the llama-server sitting of
benchmarks/peers/hint_policies.py at a 10 s horizon came after their window), and a client that
honoured its hint must get in."""

LAPSED_MEMORY_S = 30.0
"""An appointment whose window closed is remembered this long, so that a late return is counted
`late` rather than as a new client; after that it counts `never`."""


def identity_of(tenant: Owner | None, resent: object) -> int:
    """What recognises a client re-sending a refused request without its ticket (`Ask.identity`):
    its tenant (the object, one per name while the tenant is configured) and what it re-sends (a door's
    choice: an NDJSON id and prompt, an HTTP body). Python's hash is keyed per process (SipHash):
    nobody outside can make another request's identity. Never 0 (0 is no identity)."""
    return hash((tenant, resent)) or 1


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

    __slots__ = ("appointment", "keys")

    def __init__(self, appointment: Appointment, keys: tuple[object, ...]) -> None:
        self.appointment = appointment  # (its `closes`: when its window closed)
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
        "stretch",
    )

    def __init__(
        self,
        grace_s: float,
        hints: RetryHintEstimator,
        lobby: bool = False,
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
        self.books: list[Book] = []
        # The limits that book appointments (none with --retry-hint fixed): reported from the start.
        self.reasons: tuple[str, ...] = ()
        self.by_ticket: dict[str, Appointment] = {}
        # By identity, the appointments of the clients sending that request, in booking order.
        self.by_identity: dict[int, list[Appointment]] = {}
        self.lapsed: dict[object, Lapsed] = {}  # by ticket and by identity, oldest first
        self.outcomes: dict[tuple[str, str], int] = {}
        self._new_ticket = new_ticket or Tickets()
        # Whether a holder that comes in its window before its capacity frees is held (lobby.py)
        # rather than told the next release at once: fixed when the registry is built.
        self.lobby = lobby
        # An appointment's rank now (its class, then whether its tenant is over its fair share),
        # while tenants share capacity (admission sets it); None: ranks stay as booked.
        self.standing: Callable[[Appointment], int] | None = None
        # Counts the changes of the tenants' standings (who is over its share): a book re-ranks
        # its appointments when consulted after one, not on every frame.
        self.standings = 0
        # How much longer than forecast the capacity promised may take to free
        # (ReleaseForecast.stretch, set by admission: its forecast is optimistic on lengths while
        # few requests ended); whether a promise fits the horizon is judged on the wait stretched.
        self.stretch: Callable[[], float] = _unstretched

    @property
    def round_delay_s(self) -> float:
        """How long after its appointment a holder's request starts: its learnt lateness and a
        millisecond of margin. An appointment's slot is free again a service time after that.
        Erring late is safe (the slot is kept for its holder through the window); early is not."""
        return self.lateness_s + HINT_RESOLUTION_S

    def learn_release(self, late_s: float) -> None:
        """A holder's capacity came free `late_s` after it was due (`Appointment.due`; 0: it was
        free when the holder came)."""
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

    def count(self, book: Book, rank: int, outcome: str) -> None:
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
        record = Lapsed(appointment, keys)
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
            record = lapsed[next(iter(lapsed))]
            oldest = record.appointment
            if now - oldest.closes < LAPSED_MEMORY_S and len(lapsed) < 65536:
                return
            self._drop(record)
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
        appointment whenever it comes. A late return is kept (`_late`) or counted here."""
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
            if record is not None and record.appointment.tenant is tenant:
                self._drop(record)
                return self._late(record.appointment, now)
        return None

    def _late(self, lapsed: Appointment, now: float) -> Appointment | None:
        """Its holder came after its window closed. Within `LATE_KEPT_S` of the close and inside
        its promise horizon, a capacity book's holder is still owed the promise (`keeps_late`):
        booked again from now, so it goes ahead of whoever was promised later (it is counted
        `late` when admitted); later than that, counted `late` here and taken for a new client."""
        book = lapsed.book
        if (
            book.keeps_late
            and now - lapsed.closes <= LATE_KEPT_S
            and (now - lapsed.booked_at) * 1000.0 < self.hints.policy.horizon_ms
        ):
            lapsed.late = True
            book.move(lapsed, now)
            return lapsed
        self.count(book, lapsed.rank, LATE)
        return None


def _unstretched() -> float:
    """A registry's `stretch` before admission sets its forecast's: the forecast is taken as it is."""
    return 1.0
