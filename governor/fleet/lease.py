"""This replica's lease on the fleet's caps: their values and timing (`FleetPolicy`), the reply
of a renewal (`LeaseReply`), and `FleetLease`, the admission `Limit` that enforces this replica's
shares (`check`, `charge`, `refund`, `release`; the in-flight share books the clients it refuses
in admission's book, `keep`, `growth`) and the state machine of its renewals (`report` when one is
sent, `apply` with its reply, `lapse` when none came, and the fallback). Pure logic: the clock is
passed in. The shares and the demand they measure are shares.py; why it all works
as it does, the package's docstring.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

from governor.admission.caps import Caps
from governor.admission.cost import Ask
from governor.admission.hints import RetryHintEstimator
from governor.admission.limits import Grant, Refusal, hint_of, over_budget
from governor.fleet.shares import HeldShare, RateShare, Share
from govwire.vocab import YieldReason

if TYPE_CHECKING:
    from governor.admission.appointments.books import AppointmentBook

LEASE_SCRIPT = resources.files("governor.fleet").joinpath("lease.lua").read_text(encoding="utf-8")
"""The allocation, run atomically in Redis for each renewal."""

RESOURCES = ("inflight", "qps", "tokens", "token_rate")
"""The fleet limits, in the order a renewal reports them (the script's resource index)."""

EARLY_FRACTION = 4
"""An early renewal (member.py) comes at most every renew_s / EARLY_FRACTION."""


@dataclass(frozen=True)
class FleetPolicy(Caps):
    """The fleet's caps (caps.Caps: 0 = that one is not shared) and the lease timing."""

    renew_s: float = 0.25
    lease_s: float = 1.0
    unavailable: Literal["hold", "closed", "local"] = "hold"
    hold_s: float = 10.0  # with `hold`: how long a lapsed replica admits within its last shares
    max_request_s: float = 30.0  # how long what a lapsed replica admitted may still run

    def __post_init__(self) -> None:
        if not 0 < self.renew_s * 2 <= self.lease_s < math.inf:
            raise ValueError("the lease must last at least two renewal periods (and renewals be > 0)")
        if not (0 <= self.hold_s < math.inf and 0 < self.max_request_s < math.inf):
            raise ValueError("the hold must be finite and >= 0, the longest request finite and > 0")
        if min(self.max_inflight, self.max_inflight_tokens) < 0 or not self.rates_are_finite():
            raise ValueError("fleet limits must be finite and >= 0")

    @property
    def any(self) -> bool:
        return bool(self.max_inflight or self.max_qps or self.max_inflight_tokens or self.max_tokens_per_s)

    @property
    def tail_s(self) -> tuple[float, float]:
        """How long Redis keeps a lapsed entry reserved after its expiry: (everything, held
        resources). Nothing under `local`, which reserves nothing."""
        if self.unavailable == "local":
            return 0.0, 0.0
        hold = self.hold_s if self.unavailable == "hold" else 0.0
        return hold, hold + self.max_request_s


CLOCK_MARGIN = 1e-3
"""The rate by which this replica's clock may run slow against Redis's (1000 ppm, ten times what
an unsynchronised quartz drifts): the windows a lapse opens here (the hold, the cut) end this
much earlier than the reservations Redis keeps for them."""


class FleetState(StrEnum):
    """Where this replica's lease stands (`stats` and the logs)."""

    JOINING = "joining"  # no renewal has succeeded yet
    LEASED = "leased"
    HOLDING = "holding"  # lapsed; --fleet-unavailable hold: the last shares, until the hold ends
    CLOSED = "closed"  # lapsed (or never joined) and admitting nothing: every frame yields
    LOCAL = "local"  # lapsed; --fleet-unavailable local: the limit / the last known replica count


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """What one renewal returned: the live replica count, the renewal's number, the lapsed
    replicas whose reservations stand, and per resource (RESOURCES order) this replica's share, the limit in force, the
    fleet's usage, the fleet's wants, this replica's target (above its share while others still
    hold what it is owed) and what the others keep reserved."""

    replicas: int
    seq: int  # the renewal's number
    lapsed: int
    shares: tuple[float, ...]
    limits: tuple[float, ...]
    usage: tuple[float, ...]
    wants: tuple[float, ...]
    targets: tuple[float, ...]
    others: tuple[float, ...]

    @classmethod
    def parse(cls, raw: list[Any]) -> LeaseReply:
        if len(raw) == 1 and int(raw[0]) == -1:
            raise ValueError("Redis had run a later renewal of this replica's (this one came late)")
        numbers = [float(x) for x in raw[3:]]
        if len(numbers) != 6 * len(RESOURCES):
            raise ValueError(f"a lease reply has {len(RESOURCES)} resources of 6 numbers, got {raw!r}")
        return cls(int(raw[0]), int(raw[1]), int(raw[2]), *(tuple(numbers[i::6]) for i in range(6)))


class FleetLease:
    """The fleet limits as one `Limit` (a `SharedLimit`, admission/limits.py), checked after the
    replica's own caps. Fed by member.FleetMember: `report` when a renewal is sent, `apply` with
    its reply, `lapse` when none came. Pure logic: the clock is passed in."""

    __slots__ = (
        "policy",
        "state",
        "replicas",
        "valid_until",
        "shares",
        "next_renewal",
        "rtt_s",
        "inflight",
        "tokens",
        "qps",
        "token_rate",
        "closed",
        "could_grow",
        "lapsed",
        "hold_until",
        "cut_at",
        "renewed_at",
        "applied_seq",
        "_hints",
        "_others",
        "_reported_at",
        "_unavailable",
        "nudge",
        "_booking",
    )

    def __init__(self, policy: FleetPolicy, hints: RetryHintEstimator, now: float) -> None:
        self.state = FleetState.JOINING
        self.closed = False  # no lease and --fleet-unavailable closed: every frame yields
        # As of the last reply, a renewal may bring a share more: one is under its target, or the
        # fleet wants less than a limit (what this replica refuses now would raise its target).
        self.could_grow = True
        self.replicas = 1  # as of the last reply: the local fallback divides the limits by it
        self.lapsed = 0  # as of the last reply: lapsed replicas whose reservations still stand
        self.valid_until = -math.inf  # the lease in force lapses here (monotonic seconds)
        self.renewed_at = -math.inf  # when the renewal that granted it was sent
        self.applied_seq = 0  # that renewal's number: Redis holds at least it, unless it lost writes
        # Once it lapses (hold, closed): until when the fallback admits within the last shares, and
        # when whatever still runs must be cancelled, so that nothing is in use here once Redis
        # hands the reservation to the others. None: no cut (local, or nothing was ever admitted).
        self.hold_until = -math.inf
        self.cut_at: float | None = None
        self.next_renewal = now  # when the member sends its next renewal
        self.rtt_s = 0.0  # the last renewal's round trip
        self.inflight = HeldShare(YieldReason.FLEET_INFLIGHT, hints)
        self.tokens = HeldShare(YieldReason.FLEET_TOKENS, hints)
        self.qps = RateShare(YieldReason.FLEET_QPS)
        self.token_rate = RateShare(YieldReason.FLEET_TOKEN_RATE)
        self.shares: tuple[Share, ...] = (self.inflight, self.qps, self.tokens, self.token_rate)  # RESOURCES order
        self._hints = hints
        self._others: tuple[tuple[Share, bool], ...] = ()  # the limited shares but in-flight: (share, by cost)
        self._reported_at = now
        self._unavailable = Refusal(YieldReason.FLEET_UNAVAILABLE)
        # Wakes the member's renewals (member.py): the in-flight share's first refusal of a period
        # promised what the next renewal brings, which it sends as soon as an early one may go.
        self.nudge: Callable[[], None] = _nothing
        # The in-flight share's book while it promises (`keep`, and no other replica's clients
        # wait as of the last reply: `apply`); None: its refusals hint without booking.
        self._booking: AppointmentBook | None = None
        self.policy = policy
        self.set_policy(policy, now)

    def set_policy(self, policy: FleetPolicy, now: float) -> None:
        """The limits (at start, and live on SIGHUP): reported with the next renewal, and at once
        in force where the fallback applies. Before its first renewal a replica holds nothing."""
        self.policy = policy
        self.inflight.limit = policy.max_inflight
        self.tokens.limit = policy.max_inflight_tokens
        self.qps.limit, self.qps.burst = policy.max_qps, policy.qps_burst or max(1.0, policy.max_qps)
        rate = policy.max_tokens_per_s
        self.token_rate.limit, self.token_rate.burst = rate, policy.tokens_burst or max(1.0, rate)
        others = ((self.qps, False), (self.tokens, True), (self.token_rate, True))
        self._others = tuple((share, by_cost) for share, by_cost in others if share.limit)
        if self.state is FleetState.LOCAL or self.state is FleetState.CLOSED:
            self._fall_back(now)

    def set_caps(self, policy: FleetPolicy, now: float) -> None:
        """Live change of the fleet caps (SIGHUP), reported with the next renewal; the lease's
        timing and fallback stay as they started."""
        kept = self.policy
        timing = dataclasses.replace(
            policy,
            renew_s=kept.renew_s,
            lease_s=kept.lease_s,
            unavailable=kept.unavailable,
            hold_s=kept.hold_s,
            max_request_s=kept.max_request_s,
        )
        self.set_policy(timing, now)

    @property
    def caps_tokens(self) -> bool:
        """Whether a fleet token budget bounds what one request may cost (`fits`)."""
        return bool(self.policy.max_inflight_tokens or self.policy.max_tokens_per_s)

    # --- the Limit -----------------------------------------------------------------------------

    def fits(self, ask: Ask) -> None:
        """OverBudget for a request larger than a whole fleet token budget: it could never run."""
        tokens = self.tokens.limit
        if tokens and ask.cost > tokens:
            raise over_budget(ask, int(tokens), "--fleet-max-inflight-tokens")
        burst = self.token_rate.burst
        if self.token_rate.limit and ask.cost > burst:
            raise over_budget(ask, int(burst), "the --fleet-tokens-burst")

    def room(self, grant: Grant, now: float) -> float:
        """How many more requests like `grant`'s the in-flight and token shares would admit now
        (none while closed; the rate shares are left out)."""
        if self.closed:
            return 0
        room = math.inf
        if self.inflight.limit:
            room = self.inflight.share - self.inflight.holding
            book = self.inflight.book
            if book is not None and book.entries:
                room -= book.held(now, None, grant.ask.rank)
        if self.tokens.limit:
            room = min(room, (self.tokens.share - self.tokens.holding) // max(1, grant.ask.cost))
        return room

    def check(self, now: float, ask: Ask) -> Refusal | None:
        state = self.state
        if now >= self.valid_until and (
            state is FleetState.LEASED or (state is FleetState.HOLDING and now >= self.hold_until)
        ):
            self._fall_back(now)
        if self.closed:
            # Counted as waiting on the in-flight share, so that the renewal that rejoins asks for
            # what waits here rather than for nothing.
            hint_ms = self.renewal_hint(now)
            self.inflight.refuse(now, 1, hint_ms)
            return self._unavailable.at(hint_ms)
        held = self.inflight
        if held.limit:
            cap = held.share * ask.ceiling
            book = self._booking
            if book is not None:
                if held.holding + 1 > cap or (
                    book.entries and held.holding + 1 + book.held(now, ask.appointment, ask.rank) > cap
                ):
                    return self._promise(now, ask, cap, book)
            elif held.holding + 1 > cap:
                # Nothing kept (--retry-hint fixed, or a lease admission did not join): its slots
                # free as this replica's requests end: the replica's release timeline
                # (hints.RetryHintEstimator), scaled from its capacity to the share; with
                # --retry-hint fixed, the base hint. With nothing held here to drain (or, adaptive,
                # no service time yet), the next renewal. (Inline: this refuses every frame while
                # the share is full.)
                hints = self._hints
                if not held.holding or cap < 1 or (not hints.service_time_s and hints.policy.adaptive):
                    return held.refuse(now, 1, self.renewal_hint(now))
                deficit = held.holding + 1 - math.floor(cap)
                return held.refuse(now, 1, hints.hint_ms(now, deficit * hints.capacity / held.share))
        for share, by_cost in self._others:
            refusal = share.over(now, ask.cost if by_cost else 1, ask.ceiling, self)
            if refusal is not None:
                return refusal
        return None

    def _promise(self, now: float, ask: Ask, cap: float, book: AppointmentBook) -> Refusal:
        """A refusal of the in-flight share, booked (appointments.AppointmentBook): the k-th
        refused client is promised the k-th slot nobody was promised yet, first those a renewal
        can grow the share by (`growth`), then this replica's releases (build.fleet_book). Counted
        against the share the fleet's demand gives it when that is smaller (its releases above
        it go back to the fleet first), so that the promise survives the shrink. What it cannot
        promise within the horizon is no final refusal while a renewal could bring the share
        more (the fleet wants less than the cap, or this replica is owed more): the next renewal,
        nothing kept, as before a share is known."""
        held = self.inflight
        if not held.refusals:
            self.nudge()
        keeping = cap
        if 0 < held.target * ask.ceiling < cap:
            keeping = held.target * ask.ceiling
        hint_ms, appointment = book.refuse(now, ask, held.holding + 1 - math.floor(keeping), 1.0)
        if appointment is None and self.could_grow and hint_ms >= self._hints.policy.horizon_ms:
            hint_ms = self.renewal_hint(now)
        refusal = held.refuse(now, 1, hint_ms)
        refusal.appointment = appointment
        return refusal

    def keep(self, book: AppointmentBook) -> None:
        """Book the clients the in-flight share refuses in `book` (admission's, build.fleet_book),
        and report what it promised with each renewal (shares.HeldShare.report)."""
        self.inflight.book = self._booking = book

    def growth(self, now: float) -> tuple[tuple[int, float], ...]:
        """The slots renewals can grow the in-flight share by, and when each comes: (how many,
        when), in order. First what the fleet left free as of the last reply (the script grants
        a replica that wants more up to that), at the reply of the next renewal: the next early
        one's while one could bring more (member.py sends it an early period after the last,
        nudged by the first refusal), else the next one's. While the others wanted nothing, then
        what they were granted and did not use: they give it back once that renewal shows the
        fleet wants more than the cap (an early renewal of theirs), and it comes with the reply
        of this replica's renewal after, two early periods later. While others want some too,
        only its part of the free slots, as the script would split them by what each wants (this
        replica's demand now against the others' last). Nothing without a lease in force."""
        if self.state is not FleetState.LEASED:
            return ()
        held = self.inflight
        free = max(0, math.floor(held.limit - held.fleet_granted + 1e-9))
        others = held.fleet_want - held.asked  # what the others wanted (the script splits by want)
        idle = 0
        if others > 0:
            mine = held.holding + 1 + (held.book.promised if held.book is not None else 0)
            free = math.floor(free * mine / (mine + others))
        else:  # granted to the others, less what they used
            idle = max(0, math.floor(held.fleet_granted - held.share - (held.fleet_usage - held.reported) + 1e-9))
        renew_s = self.policy.renew_s
        early_s = renew_s / EARLY_FRACTION
        due = self.next_renewal
        if self.could_grow:
            due = min(due, self.next_renewal - renew_s + early_s)
        due = max(now, due) + self.rtt_s
        return (free, due), (idle, due + 2 * early_s)

    def renewal_hint(self, now: float) -> int:
        """Until the next renewal's reply may change the share."""
        return hint_of(max(0.0, self.next_renewal - now) + self.rtt_s)

    def charge(self, grant: Grant, now: float) -> None:
        cost = grant.ask.cost
        held = self.inflight
        held.take(1)
        if held.book is not None and held.book.entries:
            held.book.redeem(grant.ask.appointment, now)
        self.tokens.take(cost)
        for rate, amount in ((self.qps, 1.0), (self.token_rate, float(cost))):
            rate.admitted += amount
            if rate.bucket is not None:
                rate.bucket.take(amount)

    def refund(self, grant: Grant) -> None:
        if self.qps.bucket is not None:
            self.qps.bucket.refund()  # the rest is freed by `release`, as for any request that ends
        self.qps.admitted -= 1

    def release(self, grant: Grant, executed: bool) -> None:
        self.inflight.give(1)
        self.tokens.give(grant.ask.cost)
        rate = self.token_rate
        rate.admitted += grant.used - grant.ask.cost
        if rate.bucket is not None:
            rate.bucket.refund(grant.ask.cost - grant.used)

    # --- the lease -----------------------------------------------------------------------------

    def renewal_args(self, member: str, seq: int, now: float) -> list[str | float]:
        """The script's ARGV for renewal number `seq` of `member`, sent at `now` (lease.lua's
        header says what each is): the one place that knows their order."""
        hold_s, release_s = self.policy.tail_s
        tail_ms = (round(hold_s * 1000), round((release_s - hold_s) * 1000))
        head: list[str | float] = [member, seq, self.known_seq(now), round(self.policy.lease_s * 1000), *tail_ms]
        return [*head, len(RESOURCES), *self.report(now)]

    def report(self, now: float) -> list[float]:
        """The renewal's per-resource numbers (the script's ARGV after its header). A new
        measurement period starts unless the last one began under half a renewal period ago (a
        confirmation right after a reply): rates measured over a few milliseconds are noise.
        What the share must keep counts the appointments due before the renewal after next
        could change it (two periods and a round trip): each is reported by one renewal at least
        before its time."""
        elapsed = now - self._reported_at
        if elapsed < self.policy.renew_s / 2:
            elapsed = 0.0
        else:
            self._reported_at = now
        soon_s = 2 * self.policy.renew_s + self.rtt_s
        return [x for share in self.shares for x in share.report(now, elapsed, soon_s)]

    def apply(self, reply: LeaseReply, sent_at: float, now: float, durable: bool = True) -> bool:
        """Apply a renewal's reply, and return whether a share shrank (the member then confirms at
        once, so that Redis frees the difference). A reply that is not `durable` (too few Redis
        replicas acknowledged it: a failover may lose it) neither renews the lease nor grows a
        share; a share may shrink, while the lease in force lasts."""
        self.replicas = max(1, reply.replicas)
        self.lapsed = reply.lapsed
        self.rtt_s = now - sent_at
        if now >= sent_at + self.policy.lease_s:
            self.lapse(now)  # the lease it would renew ran out meanwhile: it grants nothing
            return False
        if durable:
            self.valid_until = sent_at + self.policy.lease_s
            self.renewed_at = sent_at
            self.applied_seq = max(self.applied_seq, reply.seq)
            self.state = FleetState.LEASED
            self.closed = False
            self._set_tail()
        elif self.state is not FleetState.LEASED or now >= self.valid_until:
            self.lapse(now)
            return False
        shrank = could_grow = False
        for share, granted, usage, want, target, others in zip(
            self.shares, reply.shares, reply.usage, reply.wants, reply.targets, reply.others, strict=True
        ):
            if not durable:
                granted = min(granted, share.share)
            shrank = shrank or granted < share.share
            could_grow = could_grow or (share.limit > 0 and (granted < target * 0.99 or want < share.limit))
            share.set_share(granted, now)
            if isinstance(share, HeldShare):
                share.target = target
                if target >= granted:
                    share.shrinking_since = None
                elif share.shrinking_since is None:
                    share.shrinking_since = now
            share.fleet_usage, share.fleet_want, share.fleet_granted = usage, want, others + granted
        self.could_grow = could_grow
        # Promises are made while only this replica's clients wait: under contention the shares
        # move at every renewal (each replica's part follows every one's demand) and nobody can
        # tell which replica a release of the fleet will go to, so its refusals hint without
        # booking, as a share did before it kept appointments.
        held = self.inflight
        others_waiting = (held.fleet_want - held.asked) - (held.fleet_usage - held.reported)
        self._booking = held.book if others_waiting < 1 else None
        return shrank

    @property
    def refusing(self) -> bool:
        """Whether a fleet share refused a frame since the last report (the member renews early)."""
        return any(share.refusals for share in self.shares)

    def giving_back(self, now: float) -> bool:
        """Whether a held share could free capacity the fleet waits for (the member renews early)."""
        return self.state is FleetState.LEASED and (self.inflight.giving_back(now) or self.tokens.giving_back(now))

    def known_seq(self, now: float) -> int:
        """The number of the last renewal whose reply it applied, while Redis must still hold
        its entry (the script reads an entry older than that as writes Redis lost); 0 once the
        reservation may have ended (a step before Redis drops it), and before any lease."""
        _, release = self.policy.tail_s
        return self.applied_seq if now < self.renewed_at + self.policy.lease_s + release else 0

    def _set_tail(self) -> None:
        """When the lease in force would end its fallback and cut what runs, were it to lapse
        (both reckoned from its own end, and a little early: CLOCK_MARGIN)."""
        hold, release = self.policy.tail_s
        slow = 1.0 - CLOCK_MARGIN
        self.hold_until = self.renewed_at + (self.policy.lease_s + hold) * slow
        cut_at = self.renewed_at + (self.policy.lease_s + release) * slow
        self.cut_at = None if self.policy.unavailable == "local" else cut_at

    def lapse(self, now: float) -> None:
        """Apply the fallback if no lease is in force: the one in force ran out with no renewal
        (checked by every frame, and by the member after a failed renewal, so it shows even
        without traffic), or the first renewal failed; and close a hold that has ended."""
        if self.state is FleetState.LEASED and now < self.valid_until:
            return
        if self.state is FleetState.HOLDING and now < self.hold_until:
            return
        self._fall_back(now)

    def _fall_back(self, now: float) -> None:
        """No lease in force. `hold`: the last shares until the hold ends (Redis keeps them
        reserved), then nothing; `closed`, or no lease ever: nothing; `local`: the limits
        divided by the last known replica count."""
        unavailable = self.policy.unavailable
        if unavailable == "local":
            self.closed = False
            if self.state is not FleetState.JOINING:
                self.state = FleetState.LOCAL
            n = self.replicas
            for share in (self.inflight, self.tokens):
                share.set_share(share.limit // n, now)
            for rate in (self.qps, self.token_rate):
                rate.set_share(rate.limit / n, now)
            return
        if unavailable == "hold" and self.state is not FleetState.JOINING and now < self.hold_until:
            self.state = FleetState.HOLDING  # its shares stay as the last reply left them
            return
        self.closed = True
        if self.state is not FleetState.JOINING:
            self.state = FleetState.CLOSED
        for closing in self.shares:
            closing.set_share(0.0, now)


def _nothing() -> None:
    """No member renews this lease (its tests): nothing to nudge."""
