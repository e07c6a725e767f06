"""One appointment and its phases: every change of an appointment's state happens here (h11's
rule for its own state machine: what affects the state lives in the file that holds it).

    BOOKED ──hold──▶ HELD ──call_last──▶ LAST_CALL
      ▲  │             │                    │
      │  │             └──────unhold────────┴──▶ BOOKED   (answered, its appointment kept)
      │  ├─redeem─▶ REDEEMED     (from BOOKED, HELD, LAST_CALL: its holder was admitted)
      │  ├─lapse──▶ LAPSED       (from BOOKED: its window closed without its holder)
      │  └─give_back─▶ GIVEN_BACK (from any live phase: out of its book otherwise)
      └──────rebook──────┘       (GIVEN_BACK → BOOKED: moved to a new time, ticket and identity
                                  kept; LAPSED → BOOKED: its holder came a little late, kept)

A live appointment (BOOKED, HELD, LAST_CALL) is in its book and found by its ticket and identity;
the others are in no book. The book (books.py) and the registry (registry.py) keep the indexes;
the lobby (lobby.py) holds the clients; each calls the transition here that says what happened.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from governor.admission.priority import STANDARD_RANK

Owner = object
"""The tenant an appointment was booked for (tenant.Tenant): compared by identity only (a ticket
is valid for its own tenant), so the appointments need to know nothing else of tenants (whose
own caps keep books of these)."""


class Book(Protocol):
    """What an appointment, its holders and the registry read of its book (books.AppointmentBook,
    which imports this module: the Protocol keeps the imports one way)."""

    reason: str
    keeps_late: bool
    entries: list[Appointment]
    trust: list[float]
    used: list[int]
    promised: float

    @property
    def half_grace_s(self) -> float: ...

    def sweep(self, now: float) -> None: ...

    def regrace(self) -> None: ...

    def remove(self, appointment: Appointment, redeemed: bool = False) -> None: ...

    def move(self, appointment: Appointment, at: float) -> None: ...

    def refused_elsewhere(self, own: Appointment) -> None: ...

    def redeem(self, appointment: Appointment | None, now: float) -> None: ...


class Asker(Protocol):
    """What a book reads of a refused frame's ask (cost.Ask): the appointment it came back with,
    whose it is, what it re-sent and where it stands."""

    @property
    def appointment(self) -> Appointment | None: ...

    @property
    def tenant(self) -> Owner | None: ...

    @property
    def identity(self) -> int: ...

    @property
    def rank(self) -> int: ...


class Phase(Enum):
    BOOKED = "booked"  # in its book; its holder not back (its window: `opened`)
    HELD = "held"  # its holder came back in its window and waits in the lobby for the capacity kept
    LAST_CALL = "last_call"  # held to its promise horizon: decided once more, then refused for good
    REDEEMED = "redeemed"  # its holder was admitted
    LAPSED = "lapsed"  # its window closed without its holder (remembered a while: registry.Lapsed)
    GIVEN_BACK = "given_back"  # refused elsewhere, left the lobby, booked anew, refused for good, unpaid


_LIVE = frozenset({Phase.BOOKED, Phase.HELD, Phase.LAST_CALL})
_IN_LOBBY = frozenset({Phase.HELD, Phase.LAST_CALL})


class AppointmentError(RuntimeError):
    """A transition its phase does not allow: a bug, never a client's doing."""


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
        "phase",
        "came_at",
        "booked_at",
        "due",
        "late",
    )

    def __init__(
        self,
        at: float,
        amount: float,
        book: Book,
        tenant: Owner | None,
        identity: int,
        rank: int = STANDARD_RANK,
        displaced: bool = False,
    ) -> None:
        self.at = at  # when the client was told to come back (monotonic seconds, whole ms of its hint)
        self.rank = rank  # its client's standing (Ask.rank): it holds against that rank and those below
        self.amount = amount  # what it was promised: 1 slot, or its token cost
        self.book = book
        self.tenant = tenant
        self.identity = identity
        self.ticket = ""
        self.closes = 0.0  # the end of its window (`at` + half the grace)
        self.displaced = displaced  # booked for a displaced request (displacement.py): its return is never displaced
        self.phase = Phase.BOOKED
        self.came_at = 0.0  # when its holder came back, if it was held
        self.booked_at = at  # when its client was first refused (its promise horizon counts from then)
        # When its capacity is due free at the latest, as the promise was judged (`at`, or later
        # while the forecast it was told from is optimistic: ReleaseForecast.stretch): how late a
        # release comes is counted from here, not from a time told early on purpose.
        self.due = at
        self.late = False  # its holder came after its window closed and was kept (registry.Appointments._late)

    def __repr__(self) -> str:
        return f"Appointment({self.book.reason}, at={self.at:.3f}, {self.phase.value})"

    @property
    def live(self) -> bool:
        """In its book: kept for its holder, found by its ticket and identity."""
        return self.phase in _LIVE

    @property
    def in_lobby(self) -> bool:
        """Its holder is here, held until its capacity frees (lobby.py)."""
        return self.phase in _IN_LOBBY

    @property
    def last_call(self) -> bool:
        return self.phase is Phase.LAST_CALL

    def opened(self, now: float) -> bool:
        """Whether its window has opened by `now`: `at` <= now + half the grace, the one test of
        it everywhere (the book bisects its times the same way), so that no float rounding makes
        a window open for the book and not for its holder."""
        return self.at <= now + self.book.half_grace_s

    # -- transitions ------------------------------------------------------------------------------

    def _expect(self, allowed: frozenset[Phase], to: Phase) -> None:
        if self.phase not in allowed:
            raise AppointmentError(f"{self!r} cannot become {to.value}")
        self.phase = to

    def hold(self, now: float) -> None:
        """Its holder came back in its window before its capacity freed: held in the lobby."""
        self._expect(_BOOKED, Phase.HELD)
        self.came_at = now

    def call_last(self) -> None:
        """Held to its promise horizon: the next decision is its last."""
        self._expect(_IN_LOBBY, Phase.LAST_CALL)

    def unhold(self) -> None:
        """Its holder was answered and left the lobby; an appointment still live is kept (its
        book decides what becomes of it), one that left its book stays as it left."""
        if self.phase in _IN_LOBBY:
            self.phase = Phase.BOOKED

    def redeem(self) -> None:
        """Its holder was admitted."""
        self._expect(_LIVE, Phase.REDEEMED)

    def lapse(self) -> None:
        """Its window closed without its holder."""
        self._expect(_BOOKED, Phase.LAPSED)

    def give_back(self) -> None:
        """Out of its book for any other reason: the capacity is anyone's."""
        self._expect(_LIVE, Phase.GIVEN_BACK)

    def rebook(self, at: float) -> None:
        """Given back, or lapsed and its holder back a little late, to be booked again at `at`,
        with its ticket and identity (the book inserts it)."""
        self._expect(_REBOOKABLE, Phase.BOOKED)
        self.at = self.due = at


_BOOKED = frozenset({Phase.BOOKED})
_REBOOKABLE = frozenset({Phase.GIVEN_BACK, Phase.LAPSED})
