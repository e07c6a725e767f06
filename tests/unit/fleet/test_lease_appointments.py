"""The fleet's in-flight share keeps appointments: a replica's real `Admission` joined to a
`FleetLease` renewed through lease.lua (run by lupa over a dict, test_lease.LuaRedis), in front of
the simulated engine of the appointments' tests, on a simulated clock."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from benchmarks.harness.fixtures.fleet_probe import reserved
from governor.admission.appointments.appointment import Appointment
from governor.admission.decision import Admission
from governor.admission.limits import Grant, Refusal
from governor.fleet.lease import EARLY_FRACTION, FleetLease, FleetPolicy
from tests.unit.admission.test_appointments import Engine, ask, governor
from tests.unit.fleet.test_lease import LuaRedis, admit, hints

POLICY = FleetPolicy(max_inflight=8, renew_s=0.25, lease_s=1.0)
SERVICE_S = 0.3  # 11 tokens: the first at 0.1 s, then one every 20 ms


def replica(redis: LuaRedis) -> tuple[Admission, Engine, FleetLease]:
    """A replica whose admission books its fleet refusals (its own cap far above the fleet's), on
    the engine's clock from 0 (Redis's clock steps back to it: the fleet's clock stays put)."""
    redis.now = 0.0
    admission, engine, _ = governor(cap=64, first_s=0.1, step_s=0.02, tokens=11)
    lease = FleetLease(POLICY, admission.hints, redis.now)
    admission.join_fleet(lease, promises=True)
    return admission, engine, lease


def renew(redis: LuaRedis, name: str, lease: FleetLease) -> None:
    """A renewal, its reply applied at once, and the confirmation a shrink asks for."""
    if lease.apply(redis.renew(name, lease), redis.now, redis.now):
        lease.apply(redis.renew(name, lease), redis.now, redis.now)


def decide(admission: Admission, engine: Engine, now: float, identity: int) -> Grant | Refusal:
    """A frame of the client `identity` (what it re-sends), started on the engine if admitted (a
    refusal is the limit's own object: read it before the next decision)."""
    outcome = admission.decide(now, ask(11, identity))
    if isinstance(outcome, Grant):
        engine.start(outcome, now)
    return outcome


def promised(admission: Admission, engine: Engine, now: float, identity: int) -> int:
    """The hint a fleet refusal gave the client `identity`, which it booked an appointment for."""
    refusal = decide(admission, engine, now, identity)
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_inflight"
    assert refusal.appointment is not None
    return refusal.hint_ms


def other_holding(redis: LuaRedis, lease: FleetLease, holding: int) -> FleetLease:
    """The other replica, renewed beside `lease` until it holds `holding` requests (it wants no
    more: its refusals' clients gone once their hints end, at the renewals' pace)."""
    other = FleetLease(POLICY, hints(), redis.now)
    held = 0
    for _ in range(12):
        while held < holding and not isinstance(admit(other, redis.now), Refusal):
            held += 1
        renew(redis, "a", lease)
        renew(redis, "b", other)
        redis.now += POLICY.renew_s
    assert other.inflight.holding == holding
    return other


def test_the_kth_refused_client_is_promised_the_kth_release_and_admitted_at_it() -> None:
    """The other replica holds 6 of 8 (and its headroom), so the fleet has nothing free and this
    one's share, all taken, frees only as its own requests end: the clients refused by the share
    are told its releases in order (its slots at 0.3 s, then the first of them again a service
    later), each kept for its client: a newcomer in the window is refused."""
    redis = LuaRedis()
    admission, engine, lease = replica(redis)
    other_holding(redis, lease, 6)
    now = redis.now
    share = int(lease.inflight.share)
    assert share >= 1 and all(slots == 0 for slots, _ in lease.growth(now))
    for identity in range(share):
        assert isinstance(decide(admission, engine, now, identity), Grant)
    hints_ms = [promised(admission, engine, now, 100 + k) for k in range(share + 1)]
    assert hints_ms[:share] == [300] * share and hints_ms[share] >= 600
    engine.run_until(now + 0.3)
    fresh = decide(admission, engine, now + 0.3, 99)
    assert isinstance(fresh, Refusal) and fresh.reason == "fleet_inflight"  # the slots are kept
    for k in range(share):
        assert isinstance(decide(admission, engine, now + 0.3, 100 + k), Grant)
    assert admission.appointments.outcomes[("fleet_inflight", "on_time")] == share


def test_an_idle_fleets_free_slots_are_promised_at_the_renewals_that_grow_the_share() -> None:
    """Both replicas idle, each with a little headroom. A burst on one: its first refusals are
    promised what the fleet has free, at the reply of the renewal its refusals bring on, the next
    what the other replica was granted and does not use, two early periods later (it gives it
    back once that renewal shows the fleet wants more than the cap); the rest its releases. The
    renewals report what it promised as wanted, its share grows by as much, and each client is
    admitted at its hint."""
    redis = LuaRedis()
    admission, engine, lease = replica(redis)
    other = other_holding(redis, lease, 0)
    now = redis.now
    share = int(lease.inflight.share)
    for identity in range(share):
        assert isinstance(decide(admission, engine, now, identity), Grant)
    (free, due), (idle, later) = lease.growth(now)
    assert free == 8 - share - other.inflight.share > 0 and due == now  # a renewal is due now
    assert idle == other.inflight.share > 0 and later > due
    hints_ms = [promised(admission, engine, now, 100 + k) for k in range(free + idle + 2)]
    assert max(hints_ms[:free]) < 50 and hints_ms[free : free + idle] == [round((later - now) * 1000)] * idle
    assert min(hints_ms[free + idle :]) >= 300
    renew(redis, "a", lease)  # the renewal due; the other's, which gives its headroom back; the next
    renew(redis, "b", other)
    renew(redis, "a", lease)
    assert lease.inflight.share == 8
    for k in range(free + idle):
        back = now + hints_ms[k] / 1000
        assert isinstance(decide(admission, engine, back, 100 + k), Grant)
    assert admission.appointments.outcomes[("fleet_inflight", "on_time")] == free + idle


def test_a_promise_made_under_one_share_survives_a_renewal_that_would_shrink_it() -> None:
    """This replica holds its whole share with three clients promised its next releases; the
    other replica's clients then want the whole cap, so the fleet's demand gives this one less.
    The renewal keeps what the appointments due soon count on; once they are kept, the next
    renewal gives the rest back."""
    redis = LuaRedis()
    admission, engine, lease = replica(redis)
    other = other_holding(redis, lease, 0)
    book, lease.inflight.book = lease.inflight.book, None  # (its demand, grown without bookings)
    for _ in range(8):
        grants = [g for g in (admit(lease, redis.now) for _ in range(8)) if isinstance(g, Grant)]
        renew(redis, "a", lease)
        renew(redis, "b", other)
        redis.now += POLICY.renew_s
        for grant in grants:
            lease.release(grant, executed=True)
    lease.keep(book)
    now, share = redis.now, int(lease.inflight.share)
    assert share >= 6
    for identity in range(share):
        assert isinstance(decide(admission, engine, now, identity), Grant)
    assert [promised(admission, engine, now, 100 + k) for k in range(3)] == [300] * 3
    other.inflight.refuse(now, 16, 250)  # the other replica's clients want twice the cap
    redis.now = now + POLICY.renew_s
    renew(redis, "b", other)
    renew(redis, "a", lease)
    renew(redis, "b", other)
    assert lease.inflight.target < share  # the demand gives this one less
    assert lease.inflight.share == share  # but its promises are kept
    engine.run_until(now + 0.3)
    for k in range(3):
        assert isinstance(decide(admission, engine, now + 0.3, 100 + k), Grant)
    redis.now = now + 2 * POLICY.renew_s
    renew(redis, "a", lease)
    assert lease.inflight.share < share  # kept, they keep nothing more: the rest goes back


# --- the properties, over any load ---------------------------------------------------------------


class KeptFleet(RuleBasedStateMachine):
    """Two replicas booking their fleet refusals, under a cap of 8: bursts of new clients at
    either, every refused client back at its hint (or never), the requests running on the
    simulated engine, each replica renewing every period (a shrink confirmed at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.redis = LuaRedis()
        self.replicas = [replica(self.redis), replica(self.redis)]
        self.redis.now = 0.0
        self.names = ("a", "b")
        self.next_identity = 1
        self.returns: list[tuple[float, int, int]] = []  # (when, replica, identity)
        self.issued: list[Appointment] = []
        for i in (0, 1):
            self.renew(i)

    def renew(self, i: int) -> None:
        """A renewal of replica i: its new share never below what it reports its appointments
        due soon and its requests count on (the promise survives the renewal), which is never
        more than the share it applies."""
        _, _, lease = self.replicas[i]
        held, now = lease.inflight, self.redis.now
        kept = held.report(now, 0.0, 2 * POLICY.renew_s + lease.rtt_s)[-1]  # (what the renewal reports)
        assert kept <= held.share
        others = {k: v for k, v in self.redis.hash.items() if k not in ("~clock", self.names[i])}
        free = POLICY.max_inflight - reserved(others, 0)  # what the other entry leaves it
        renew(self.redis, self.names[i], lease)
        assert held.share >= min(kept, free)

    def decide(self, i: int, identity: int) -> None:
        admission, engine, _ = self.replicas[i]
        now = self.redis.now
        outcome = decide(admission, engine, now, identity)
        if isinstance(outcome, Refusal) and outcome.appointment is not None and not outcome.final:
            self.issued.append(outcome.appointment)
            self.returns.append((now + outcome.hint_ms / 1000, i, identity))

    @rule(i=st.integers(0, 1), clients=st.integers(1, 12))
    def burst(self, i: int, clients: int) -> None:
        for _ in range(clients):
            self.decide(i, self.next_identity)
            self.next_identity += 1

    @rule(dt=st.floats(0.001, 0.2), come_back=st.booleans())
    def advance(self, dt: float, come_back: bool) -> None:
        """Time passes: requests end, renewals that are due run, and the clients due back come
        (or, not `come_back`, one of them never does)."""
        now = self.redis.now + dt
        for _, engine, _ in self.replicas:
            engine.run_until(now)
        self.redis.now = now
        for i, (_, _, lease) in enumerate(self.replicas):
            sent = lease.next_renewal - POLICY.renew_s
            early = lease.refusing and lease.could_grow and now - sent >= POLICY.renew_s / EARLY_FRACTION
            if lease.next_renewal <= now or early:  # as member.FleetMember renews
                self.renew(i)
        due = sorted(r for r in self.returns if r[0] <= now)
        self.returns = [r for r in self.returns if r[0] > now]
        for k, (_, i, identity) in enumerate(due):
            if come_back or k:
                self.decide(i, identity)

    @invariant()
    def never_over_the_cap(self) -> None:
        assert sum(r[2].inflight.holding for r in self.replicas) <= POLICY.max_inflight
        assert self.redis.held(0) <= POLICY.max_inflight + 1e-9

    @invariant()
    def promised_no_more_than_the_lease_can_give(self) -> None:
        """What a replica's promises count on, reported as kept, is within the share it applies,
        which Redis reserves for it: the shares in force never sum over the cap."""
        assert sum(r[2].inflight.share for r in self.replicas) <= POLICY.max_inflight
        for _, _, lease in self.replicas:
            held = lease.inflight
            report = held.report(self.redis.now, 0.0, 2 * POLICY.renew_s)
            assert report[-1] <= held.share

    @invariant()
    def every_appointment_is_in_its_book_exactly_while_live(self) -> None:
        books = [r[2].inflight.book for r in self.replicas]
        for appointment in self.issued:
            assert appointment.live == any(appointment in book.entries for book in books if book is not None)
        for book in books:
            assert book is not None and book.promised == len(book.entries)


KeptFleet.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKeptFleet = KeptFleet.TestCase
