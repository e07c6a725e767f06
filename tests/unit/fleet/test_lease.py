"""The fleet lease: lease.lua run by a Lua 5.1 interpreter (lupa, as Redis runs it) over a
dict with a simulated clock, renewing real `FleetLease` objects; no Redis, no sockets."""

from __future__ import annotations

import dataclasses
import heapq
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from lupa import lua51

from benchmarks.harness.fixtures.fleet_probe import reserved
from governor.admission.cost import Ask
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.fleet.lease import (
    CLOCK_MARGIN,
    LEASE_SCRIPT,
    FleetLease,
    FleetPolicy,
    FleetState,
    LeaseReply,
)
from governor.fleet.redis_url import FleetRedis
from governor.shell.config import GovernorConfig
from govwire.errors import OverBudget
from govwire.options import ConfigError
from tests.fakes import make_state

KEY = "fleet:leases"


class LuaRedis:
    """The commands lease.lua calls, over a dict; `now` (seconds) is what TIME answers."""

    def __init__(self) -> None:
        self.lua = lua51.LuaRuntime()
        self.now = 1000.0
        now_ms = round(self.now * 1000)  # a fleet whose hash has long existed (a new one starts frozen)
        self.hash: dict[str, str] = {"~clock": f"{now_ms} {now_ms} 0"}
        self.step = 0.0  # how far Redis's wall clock was stepped (the replicas' clocks are monotonic)
        self.seq = 0  # renewals sent (one counter for every replica: rising for each of them)
        self._script = self.lua.execute(f"return function(KEYS, ARGV, redis)\n{LEASE_SCRIPT}\nend")
        self._redis = self.lua.table_from({"call": self._call})

    def _call(self, command: str, *args: str) -> Any:
        if command == "TIME":
            micros = round((self.now + self.step) * 1e6)
            return self.lua.table_from([str(micros // 1_000_000), str(micros % 1_000_000)])
        if command == "HGETALL":
            return self.lua.table_from([x for pair in self.hash.items() for x in pair])
        if command == "HDEL":
            return int(self.hash.pop(args[1], None) is not None)
        if command == "HSET":
            pairs = args[1:]
            self.hash.update(zip(pairs[::2], pairs[1::2], strict=True))
            return len(pairs) // 2
        if command == "PEXPIRE":
            return 1
        raise AssertionError(f"lease.lua called {command}")

    def renew(self, member: str, lease: FleetLease) -> LeaseReply:
        """What FleetMember.renew sends, run at `now`."""
        lease.next_renewal = self.now + lease.policy.renew_s
        self.seq += 1
        args = lease.renewal_args(member, self.seq, self.now)
        raw = self._script(self.lua.table_from([KEY]), self.lua.table_from([str(a) for a in args]), self._redis)
        return LeaseReply.parse(list(raw.values()))

    def held(self, resource: int) -> float:
        """The sum of what Redis keeps reserved for every entry (expired or not)."""
        return reserved({k: v for k, v in self.hash.items() if k != "~clock"}, resource)


def hints() -> RetryHintEstimator:
    return RetryHintEstimator(RetryHintPolicy(), 32, random.Random(0))  # seeded jitter: reproducible examples


def admit(lease: FleetLease, now: float, cost: int = 1) -> Grant | Refusal:
    ask = Ask(cost=cost)
    refusal = lease.check(now, ask)
    if refusal is not None:
        return refusal
    grant = Grant(ask)
    lease.charge(grant, now)
    return grant


# --- the algorithm as a state machine -----------------------------------------------------------


class Fleet(RuleBasedStateMachine):
    """Three replicas sharing an in-flight cap and a rate. Renewals run the script when sent and
    reach the replica later (admissions and releases happen in between); replicas die; a replica
    is cut off from Redis (its renewal in flight lost, whether the script ran or not) while it
    goes on serving under its fallback, and heals. When its lease's reservation runs out, its
    member cancels what still runs (`cut_at`). The clock moves, never so far that a connected
    replica's lease lapses."""

    def __init__(self) -> None:
        super().__init__()
        self.redis = LuaRedis()
        self.policy = FleetPolicy(
            max_inflight=7, max_qps=50.0, qps_burst=10.0, renew_s=0.25, lease_s=1.0, hold_s=0.5, max_request_s=0.75
        )
        start = self.redis.now
        self.leases = [FleetLease(self.policy, hints(), start) for _ in range(3)]
        self.alive = [True] * 3
        self.connected = [True] * 3
        self.grants: list[list[Grant]] = [[], [], []]
        self.pending: list[tuple[LeaseReply, float] | None] = [None] * 3
        for i in range(3):  # joined, as `serve` does before it listens
            self.deliver_now(i)

    def deliver_now(self, i: int) -> None:
        reply = self.redis.renew(f"m{i}", self.leases[i])
        self.leases[i].apply(reply, self.redis.now, self.redis.now)

    @rule(i=st.integers(0, 2), requests=st.integers(1, 6))
    def admit(self, i: int, requests: int) -> None:
        if self.alive[i]:
            for _ in range(requests):
                outcome = admit(self.leases[i], self.redis.now)
                if isinstance(outcome, Grant):
                    self.grants[i].append(outcome)

    @rule(i=st.integers(0, 2), requests=st.integers(1, 6))
    def finish(self, i: int, requests: int) -> None:
        for _ in range(min(requests, len(self.grants[i]))):
            grant = self.grants[i].pop(0)
            grant.used = grant.ask.cost
            self.leases[i].release(grant, executed=True)

    @rule(i=st.integers(0, 2))
    def send(self, i: int) -> None:
        if self.alive[i] and self.connected[i] and self.pending[i] is None:
            self.pending[i] = (self.redis.renew(f"m{i}", self.leases[i]), self.redis.now)

    @rule(i=st.integers(0, 2))
    def deliver(self, i: int) -> None:
        pending = self.pending[i]
        if pending is not None:
            self.pending[i] = None
            reply, sent = pending
            if self.leases[i].apply(reply, sent, self.redis.now):
                self.send(i)  # the confirming renewal FleetMember sends at once
                self.deliver(i)

    @precondition(lambda self: sum(self.alive) > 1)
    @rule(i=st.integers(0, 2))
    def kill(self, i: int) -> None:
        self.alive[i] = False
        self.grants[i] = []  # its requests died with it
        self.pending[i] = None

    @precondition(lambda self: sum(a and c for a, c in zip(self.alive, self.connected, strict=True)) > 1)
    @rule(i=st.integers(0, 2))
    def cut_off(self, i: int) -> None:
        self.connected[i] = False
        self.pending[i] = None

    @rule(i=st.integers(0, 2))
    def heal(self, i: int) -> None:
        """Its path to Redis is back: it renews at once (its member retries every period)."""
        if self.alive[i] and not self.connected[i]:
            self.connected[i] = True
            self.send(i)
            self.deliver(i)

    @rule(ahead=st.booleans())
    def step_redis_clock(self, ahead: bool) -> None:
        """Redis's wall clock steps an hour (the replicas' monotonic clocks do not)."""
        self.redis.step += 3600.0 if ahead else -3600.0

    @rule(dt=st.floats(0.001, 0.3))
    def advance(self, dt: float) -> None:
        for i, lease in enumerate(self.leases):  # the members' periodic renewals that are due
            if self.alive[i] and self.connected[i] and self.pending[i] is None and lease.next_renewal <= self.redis.now:
                self.send(i)
                self.deliver(i)
        now = self.redis.now + dt
        renewing = zip(self.leases, self.alive, self.connected, strict=True)
        if any(alive and connected and now >= lease.valid_until for lease, alive, connected in renewing):
            return
        for lease, grants in zip(self.leases, self.grants, strict=True):
            if lease.cut_at is not None and now >= lease.cut_at and lease.state is not FleetState.LEASED:
                for grant in grants:  # what FleetMember's cut does at cut_at
                    grant.used = grant.ask.cost
                    lease.release(grant, executed=False)
                grants.clear()
        self.redis.now = now

    @invariant()
    def grants_never_sum_over_the_limits(self) -> None:
        now = self.redis.now
        live = [lease for lease, alive in zip(self.leases, self.alive, strict=True) if alive]
        for lease in live:
            lease.lapse(now)  # as the next frame's check would: the shares in force now
        assert sum(lease.inflight.holding for lease in live) <= self.policy.max_inflight
        assert sum(lease.inflight.share for lease in live) <= self.policy.max_inflight
        assert sum(lease.qps.share for lease in live) <= self.policy.max_qps + 1e-9
        banked = sum(lease.qps.bucket.level(now) for lease in live if lease.qps.bucket is not None)
        assert banked <= self.policy.qps_burst + 1e-9  # with the rates: <= burst + rate x T over any window
        assert self.redis.held(0) <= self.policy.max_inflight + 1e-9

    @invariant()
    def nothing_lapses_while_renewed(self) -> None:
        renewing = zip(self.leases, self.alive, self.connected, strict=True)
        assert all(lease.state is FleetState.LEASED for lease, alive, connected in renewing if alive and connected)


Fleet.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestFleet = Fleet.TestCase


@pytest.mark.parametrize("unavailable", ["hold", "closed", "local"])
def test_a_replica_cut_off_while_serving_never_takes_the_fleet_over_its_cap(unavailable: str) -> None:
    """The partition the state machine rarely reaches by chance, walked through: all three
    replicas hold requests, one is cut off from Redis, the other two want everything. Its
    reservation stands until its member has cancelled what still ran (hold, closed); only then
    does its capacity go to the others. `local` is the opt-in that gives the cap up."""
    fleet = Fleet()
    for lease in fleet.leases:
        lease.policy = dataclasses.replace(lease.policy, unavailable=unavailable)
        lease.set_policy(lease.policy, fleet.redis.now)
    for _ in range(4):
        for i in range(3):
            fleet.admit(i, 3)
        fleet.advance(0.2)
    assert all(lease.inflight.holding for lease in fleet.leases)
    fleet.cut_off(0)
    cut_off, peak = fleet.leases[0], 0
    while fleet.redis.now < cut_off.renewed_at + 4.0:
        fleet.admit(1, 6)
        fleet.admit(2, 6)
        fleet.advance(0.05)
        for lease in fleet.leases:
            lease.lapse(fleet.redis.now)
        peak = max(peak, sum(lease.inflight.holding for lease in fleet.leases))
    if unavailable == "local":
        assert peak > fleet.policy.max_inflight
        return
    assert peak <= fleet.policy.max_inflight
    assert cut_off.state is FleetState.CLOSED and cut_off.inflight.holding == 0
    assert sum(lease.inflight.share for lease in fleet.leases[1:]) == fleet.policy.max_inflight  # all back


def offer(redis: LuaRedis, lease: FleetLease, clients: int, seconds: float, grants: list[Grant]) -> None:
    """`clients` each ask for a slot from now on, and after a yield again at its hint, for
    `seconds`; what is admitted is appended to `grants`. The clock ends `seconds` later."""
    start = redis.now
    end = start + seconds
    attempts = [(start, i) for i in range(clients)]
    while attempts:
        at, client = heapq.heappop(attempts)
        outcome = admit(lease, at)
        if isinstance(outcome, Grant):
            grants.append(outcome)
        elif at + outcome.hint_ms / 1000 < end:  # else it is still waiting when the period ends
            heapq.heappush(attempts, (at + outcome.hint_ms / 1000, client))
    redis.now = end


def renew_all(redis: LuaRedis, leases: dict[str, FleetLease]) -> None:
    """Every replica renews once, confirming a shrunk share at once (as FleetMember does)."""
    for member, lease in leases.items():
        if lease.apply(redis.renew(member, lease), redis.now, redis.now):
            lease.apply(redis.renew(member, lease), redis.now, redis.now)


@given(demands=st.lists(st.integers(0, 40), min_size=2, max_size=4), limit=st.integers(1, 40))
@settings(max_examples=80, deadline=None)
def test_shares_follow_demand(demands: list[int], limit: int) -> None:
    """Each replica's clients try to hold `demand` requests each period (retrying at their hints):
    within a few renewals each demand is met when they fit (with a little headroom); under
    contention the cap is handed out but for the rounding and each share is its proportional part
    of the cap, within a slot and a half (whole slots; the measured demand runs a little above the
    true one), except that a replica whose part is under one slot gets one while one is free."""
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=limit)
    leases = {f"m{i}": FleetLease(policy, hints(), redis.now) for i in range(len(demands))}
    held: dict[str, list[Grant]] = {member: [] for member in leases}
    for _ in range(16):  # 4 s: the shares settle
        start = redis.now
        for (member, lease), demand in zip(leases.items(), demands, strict=True):
            while held[member]:  # a new period: every request of the last one ended
                lease.release(held[member].pop(), executed=True)
            redis.now = start
            offer(redis, lease, demand, policy.renew_s, held[member])
        renew_all(redis, leases)
    total = sum(demands)
    shares = [lease.inflight.share for lease in leases.values()]
    assert sum(shares) <= limit
    scale = limit / max(total, limit)  # 1 while the demands fit
    # Within a slot and a half: whole slots, and a measured demand a little above the true one.
    bumped = sum(1 for d in demands if d and d * scale < 1)  # given one slot, from the others' parts
    headroom = 1.5 + (max(1.0, 0.05 * limit) if total < limit else 0.0)
    for share, demand in zip(shares, demands, strict=True):
        if total <= limit - len(demands):  # clear of the boundary: every demand met
            assert share >= demand, (shares, demands, limit)
        assert demand * scale - 1.5 - bumped <= share <= max(1.0, demand * scale + headroom), (shares, demands, limit)
    if total > limit:  # contended: the cap is handed out but for the rounding
        assert sum(shares) >= limit - len(demands), (shares, demands, limit)


@pytest.mark.parametrize(
    ("unavailable", "tail_s"),
    [("hold", 2.0 + 3.0 + 0.5), ("closed", 3.0 + 0.5), ("local", 0.5)],
    ids=["hold", "closed", "local"],
)
def test_a_dead_replicas_share_returns_once_nothing_it_held_can_be_in_use(unavailable: str, tail_s: float) -> None:
    """Redis cannot tell a dead replica from one cut off that still serves: what it held comes
    back after its lease plus the hold (2 s) and the longest request (3 s) with `hold`, plus the
    longest request with `closed`, and after the lease alone with `local` (which reserves
    nothing) — each plus half a lease (the most one renewal may move the fleet's clock too far),
    within a renewal period of that, and not before."""
    redis = LuaRedis()
    policy = FleetPolicy(
        max_inflight=30, renew_s=0.25, lease_s=1.0, unavailable=unavailable, hold_s=2.0, max_request_s=3.0
    )  # type: ignore[arg-type]
    leases = {f"m{i}": FleetLease(policy, hints(), redis.now) for i in range(3)}
    renew_all(redis, leases)
    dead = leases.pop("m0")
    grants: list[Grant] = []
    while len(grants) < 10:  # its load: 10 requests, held until it dies
        offer(redis, dead, 10 - len(grants), policy.renew_s, grants)
        renew_all(redis, {"m0": dead, **leases})
    died = redis.now
    survivor, held = leases["m1"], []  # the survivor wants everything; m2 nothing
    while survivor.inflight.share < 30:
        offer(redis, survivor, 30 - len(held), policy.renew_s, held)
        renew_all(redis, leases)
        assert redis.now - died <= policy.lease_s + tail_s + policy.renew_s, survivor.inflight.share
        if redis.now - died < policy.lease_s + tail_s - policy.renew_s:  # its slots still reserved
            assert survivor.inflight.share <= 20 and survivor.inflight.fleet_granted <= 30
    assert "m0" not in redis.hash  # dropped by the first renewal past its reservation
    assert redis.now - died > policy.lease_s + tail_s - policy.renew_s


# --- this replica's side -------------------------------------------------------------------------


def test_after_a_failed_join_nothing_is_admitted_but_under_local() -> None:
    """No lease yet, no share to hold: `hold` and `closed` yield fleet_unavailable; `local`
    enforces the limit over the one replica it knows of."""
    for unavailable in ("hold", "closed"):
        lease = FleetLease(FleetPolicy(max_inflight=9, unavailable=unavailable), hints(), 0.0)  # type: ignore[arg-type]
        lease.lapse(0.0)  # the first renewal failed
        refusal = lease.check(0.0, Ask())
        assert isinstance(refusal, Refusal) and refusal.reason == "fleet_unavailable"
        assert lease.state is FleetState.JOINING and lease.cut_at is None
    local = FleetLease(FleetPolicy(max_inflight=9, max_qps=30.0, unavailable="local"), hints(), 0.0)
    local.lapse(0.0)
    assert local.state is FleetState.JOINING and local.inflight.share == 9  # the limit / 1 replica


def two_replicas(policy: FleetPolicy) -> tuple[LuaRedis, FleetLease]:
    """A replica leased beside another, both having renewed twice (shares settled)."""
    redis = LuaRedis()
    lease, other = FleetLease(policy, hints(), redis.now), FleetLease(policy, hints(), redis.now)
    renew_all(redis, {"me": lease, "other": other})
    renew_all(redis, {"me": lease, "other": other})
    assert lease.state is FleetState.LEASED and lease.replicas == 2
    return redis, lease


def test_a_lapse_holds_the_last_shares_then_closes_and_sets_the_cut() -> None:
    policy = FleetPolicy(max_inflight=9, lease_s=1.0, hold_s=2.0, max_request_s=3.0)
    redis, lease = two_replicas(policy)
    now, share = redis.now, lease.inflight.share
    assert share >= 1 and lease.check(now + 0.5, Ask()) is None
    lease.lapse(now + 0.99)
    assert lease.state is FleetState.LEASED
    assert lease.cut_at == pytest.approx(now + 6.0 * (1 - CLOCK_MARGIN))
    lease.lapse(now + 1.0)  # the lease ran out: the last shares, reserved in Redis for the hold
    assert lease.state is FleetState.HOLDING and lease.inflight.share == share
    assert lease.check(now + 2.9, Ask()) is None
    refusal = lease.check(now + 3.0, Ask())  # the hold is over (a little early: CLOCK_MARGIN)
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_unavailable"
    assert lease.state is FleetState.CLOSED and lease.inflight.share == 0
    renew_all(redis, {"me": lease})  # the path heals: it rejoins within what it kept reserved
    assert lease.state is FleetState.LEASED and lease.inflight.share >= 1


def test_closed_admits_nothing_once_lapsed_and_local_divides_the_caps() -> None:
    closed_policy = FleetPolicy(max_inflight=9, max_qps=30.0, unavailable="closed", max_request_s=3.0)
    redis, closed = two_replicas(closed_policy)
    now = redis.now
    assert closed.cut_at == pytest.approx(now + 4.0 * (1 - CLOCK_MARGIN))
    refusal = closed.check(now + 1.0, Ask())
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_unavailable"
    assert closed.state is FleetState.CLOSED
    redis, local = two_replicas(dataclasses.replace(closed_policy, unavailable="local"))
    local.lapse(redis.now + 1.0)  # each cap over the 2 replicas last seen, unreserved: no cut
    assert local.state is FleetState.LOCAL and local.inflight.share == 4 and local.qps.share == 15.0
    assert local.cut_at is None


def test_a_reply_later_than_the_lease_it_renews_grants_nothing() -> None:
    redis = LuaRedis()
    lease = FleetLease(FleetPolicy(max_inflight=4, unavailable="closed"), hints(), redis.now)
    reply = redis.renew("m", lease)
    assert not lease.apply(reply, redis.now, redis.now + 1.0)
    assert lease.state is FleetState.JOINING and lease.closed


def test_refusals_name_the_fleet_limit_and_hint_at_the_refill_or_the_renewal() -> None:
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=4, max_qps=10.0, qps_burst=4.0)
    lease = FleetLease(policy, hints(), redis.now)
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    now = redis.now
    # Alone and wanting nothing yet: headroom of one request's worth of each cap.
    assert lease.inflight.share == 1 and lease.qps.share == 2.5  # a burst of 1 at 10 x 1/4 per second
    assert lease.qps.bucket is not None and lease.qps.bucket.level(now) == 0.0  # a new share earns its tokens
    refusal = admit(lease, now)
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_qps" and refusal.hint_ms == 400
    now += 0.41
    assert isinstance(admit(lease, now), Grant)
    refusal = admit(lease, now + 0.1)
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_inflight"
    assert lease.refusing and lease.could_grow  # the member renews early: the fleet has room
    zero = FleetLease(policy, hints(), now)
    zero.apply(
        LeaseReply(3, 1, 0, (0.0,) * 4, (4, 10, 0, 0), (4, 0, 0, 0), (9, 20, 0, 0), (0,) * 4, (4, 0, 0, 0)), now, now
    )
    zero.next_renewal = now + 0.2
    refusal = admit(zero, now)  # no share: come back when the next renewal may bring one
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_inflight" and refusal.hint_ms == 200
    assert zero.refusing and not zero.could_grow  # the fleet is contended and it got its target


def test_with_fixed_hints_a_full_share_hints_the_base_value_until_only_a_renewal_can_help() -> None:
    """`--retry-hint fixed`: the in-flight and token shares hint `--retry-hint-ms` (40, no jitter
    here), with a service time known or not; a share that no release here can free waits for the
    next renewal, an exact wait in either mode."""
    hints = RetryHintEstimator(RetryHintPolicy(adaptive=False, jitter=0.0, base_ms=40), 32)
    lease = FleetLease(FleetPolicy(max_inflight=4, max_inflight_tokens=200), hints, 0.0)
    lease.apply(
        LeaseReply(2, 1, 0, (2, 0, 100, 0), (4, 0, 200, 0), (0,) * 4, (0,) * 4, (2, 0, 100, 0), (2, 0, 100, 0)),
        0.0,
        0.0,
    )
    lease.next_renewal = 0.2
    assert isinstance(admit(lease, 0.0, cost=80), Grant)
    told = []
    for cost in (40, 10, 1):  # tokens over the share; then admitted; then the in-flight share is full
        decision = admit(lease, 0.0, cost=cost)
        told.append(None if isinstance(decision, Grant) else (decision.reason, decision.hint_ms))
    hints.observe_service_time(0.4)
    refusal = admit(lease, 0.0)
    told.append((refusal.reason, refusal.hint_ms) if isinstance(refusal, Refusal) else None)
    assert told == [("fleet_tokens", 40), None, ("fleet_inflight", 40), ("fleet_inflight", 40)]
    empty = FleetLease(FleetPolicy(max_inflight=4), hints, 0.0)
    empty.apply(LeaseReply(2, 1, 0, (0,) * 4, (4, 0, 0, 0), (0,) * 4, (0,) * 4, (0,) * 4, (4, 0, 0, 0)), 0.0, 0.0)
    empty.next_renewal = 0.2
    refusal = admit(empty, 0.0)  # no share at all: only the next renewal may bring one
    assert isinstance(refusal, Refusal) and (refusal.reason, refusal.hint_ms) == ("fleet_inflight", 200)


def test_a_request_larger_than_a_fleet_token_budget_is_over_budget() -> None:
    lease = FleetLease(FleetPolicy(max_inflight_tokens=100), hints(), 0.0)
    with pytest.raises(OverBudget):
        lease.fits(Ask(cost=101))
    lease.fits(Ask(cost=100))


def test_token_shares_settle_with_the_real_cost() -> None:
    redis = LuaRedis()
    lease = FleetLease(FleetPolicy(max_inflight_tokens=200, max_tokens_per_s=1000.0), hints(), redis.now)
    # Granted half of each (another replica holds the rest): 100 tokens held, 500 per second.
    shares = (0, 500, 100, 500)
    lease.apply(LeaseReply(2, 1, 0, shares, (0, 0, 200, 1000), (0,) * 4, (0,) * 4, shares, shares), 0, 0)
    redis.now = 1.0
    grant = admit(lease, redis.now, cost=60)
    assert isinstance(grant, Grant) and lease.tokens.holding == 60
    refusal = admit(lease, redis.now, cost=60)
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_tokens"
    bucket = lease.token_rate.bucket
    assert bucket is not None
    level = bucket.level(redis.now)
    grant.used = 20
    lease.release(grant, executed=True)
    assert lease.tokens.holding == 0 and bucket.level(redis.now) == pytest.approx(level + 40)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"fleet": "redis://127.0.0.1:6379/0"}, "needs a fleet cap"),
        ({"fleet_max_inflight": 8}, "give its --fleet URL"),
        ({"fleet": "http://x", "fleet_max_inflight": 8}, "redis://"),
        ({"fleet": "redis://h/0", "fleet_max_qps": 5.0, "fleet_lease_ms": 400.0}, "two renewal periods"),
        ({"fleet": "redis://h/0", "fleet_max_inflight": -1}, ">= 0"),
        ({"fleet": "redis://:replace-me-with-a-random-one@h/0", "fleet_max_inflight": 8}, "shipped placeholder"),
        ({"fleet": "redis://app:replace%2Dme-x@h/0", "fleet_max_inflight": 8}, "shipped placeholder"),
        ({"fleet": "redis://:pw@[::1/0", "fleet_max_inflight": 8}, "--fleet: Invalid IPv6 URL"),
        ({"fleet": "redis+sentinel://s1:26379", "fleet_max_inflight": 8}, "name the service"),
        ({"fleet": "redis+sentinel://s1/mymaster", "fleet_max_inflight": 8}, "a sentinel is HOST:PORT"),
        ({"fleet": "redis+sentinel://s1:1/m?db=2", "fleet_max_inflight": 8}, "only sentinel_password"),
        ({"fleet": "redis+sentinel://:replace-me-x@s1:1/m", "fleet_max_inflight": 8}, "shipped placeholder"),
        ({"fleet": "redis://h/0", "fleet_max_inflight": 8, "fleet_replica_acks": -1}, "acks must be >= 0"),
        ({"fleet": "redis://h/0", "fleet_max_inflight": 8, "fleet_max_request_s": 0.0}, "longest request"),
    ],
)
def test_fleet_configuration_errors(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GovernorConfig(**flags)


def test_urls_are_logged_without_their_password() -> None:
    def redacted(url: str) -> str:
        return FleetRedis.parse(url).redacted()

    assert redacted("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://app:s3cret@redis:6380/1") == "rediss://app:***@redis:6380/1"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"
    sentinel = "redis+sentinel://app:s3cret@s1:26379,[::1]:26380/mymaster/2?sentinel_password=t0p"
    assert redacted(sentinel) == "redis+sentinel://app:***@s1:26379,[::1]:26380/mymaster/2"
    where = FleetRedis.parse(sentinel)
    assert where.sentinels == (("s1", 26379), ("::1", 26380)) and where.service == "mymaster" and where.db == 2
    assert (where.username, where.password, where.sentinel_password) == ("app", "s3cret", "t0p")


def test_a_reload_changes_the_fleet_caps_but_not_the_lease_timing() -> None:
    state = make_state(max_inflight=64)
    lease = FleetLease(FleetPolicy(max_inflight=8, renew_s=0.1, lease_s=0.5, unavailable="closed"), hints(), 0.0)
    state.admission.join_fleet(lease)
    lease.set_caps(FleetPolicy(max_inflight=16, max_inflight_tokens=100), 0.0)
    state.admission.fleet_caps_changed()
    assert lease.policy == FleetPolicy(
        max_inflight=16, max_inflight_tokens=100, renew_s=0.1, lease_s=0.5, unavailable="closed"
    )
    with pytest.raises(OverBudget):  # the fleet token budget is checked from now on
        state.admission.decide(0.0, Ask(cost=101))


def holder_and_taker() -> tuple[LuaRedis, FleetPolicy, FleetLease, FleetLease]:
    """Two replicas under a cap of 8 (`closed`, longest request 1 s), the holder holding five
    requests, the taker nothing: the setting of the tests of Redis's clock steps."""
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=8, renew_s=0.25, lease_s=1.0, unavailable="closed", max_request_s=1.0)
    holder, taker = FleetLease(policy, hints(), redis.now), FleetLease(policy, hints(), redis.now)
    grants: list[Grant] = []
    for _ in range(6):
        offer(redis, holder, 5 - len(grants), policy.renew_s, grants)
        renew_all(redis, {"holder": holder, "taker": taker})
    assert holder.inflight.holding == 5
    return redis, policy, holder, taker


def test_a_step_of_redis_clock_neither_expires_the_leases_nor_freezes_them() -> None:
    """Redis's wall clock jumps an hour ahead, then two hours back: the fleet's clock (lease.lua)
    counts neither jump (each is more than a lease since the last renewal) and never moves
    backwards, so the live replica's reservation is not dropped by the jump ahead, and a dead
    one's still comes back in due time after the jump back (its lease, the step kept for the
    clock and its tail, and the renewal period each jump lost, counted in renewals)."""
    redis, policy, holder, taker = holder_and_taker()
    redis.step = 3600.0  # a step ahead, between two renewals
    took: list[Grant] = []
    offer(redis, taker, 8, policy.renew_s, took)
    renew_all(redis, {"taker": taker})
    assert taker.inflight.share <= 3 and redis.held(0) <= 8  # the holder's 5 still reserved
    redis.step = -3600.0  # and back: the holder is now dead
    renewals = 0
    while taker.inflight.share < 8:
        offer(redis, taker, 8 - len(took), policy.renew_s, took)
        renew_all(redis, {"taker": taker})
        renewals += 1
        assert renewals * policy.renew_s <= policy.lease_s * 1.5 + policy.max_request_s + 2 * policy.renew_s
    # Not before: the step ahead moved the fleet's clock no further than the time that passed.
    assert renewals * policy.renew_s >= policy.lease_s + policy.max_request_s


def test_a_renewal_that_reaches_redis_after_a_later_one_changes_nothing() -> None:
    """The member gives up on a renewal after a period and sends the next; should the one given up
    on still reach Redis afterwards, the script leaves the entry as the later one wrote it."""
    redis = LuaRedis()
    lease = FleetLease(FleetPolicy(max_inflight=8), hints(), redis.now)
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    entry = redis.hash["m"]
    redis.seq -= 1  # the renewal before the last one, arriving late
    with pytest.raises(ValueError, match="later renewal"):
        redis.renew("m", lease)
    assert redis.hash["m"] == entry


def test_a_renewal_too_few_redis_replicas_acknowledged_renews_nothing_and_grows_nothing() -> None:
    """--fleet-replica-acks: a renewal not yet on enough Redis replicas could be lost in a
    failover, so it neither extends the lease (nor moves the cut) nor grows a share; a smaller
    share applies at once."""
    redis = LuaRedis()
    lease = FleetLease(FleetPolicy(max_inflight=8), hints(), redis.now)
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    assert lease.inflight.share == 1  # alone and wanting nothing: a request of headroom
    valid_until, cut_at = lease.valid_until, lease.cut_at
    grants: list[Grant] = []
    offer(redis, lease, 6, lease.policy.renew_s, grants)  # six want in
    lease.apply(redis.renew("m", lease), redis.now, redis.now, durable=False)
    assert lease.inflight.share == 1 and (lease.valid_until, lease.cut_at) == (valid_until, cut_at)
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    assert lease.inflight.share >= 6 and lease.valid_until > valid_until
    grown = lease.inflight.share
    smaller = LeaseReply(1, 99, 0, (2.0, 0, 0, 0), (8, 0, 0, 0), (0,) * 4, (0,) * 4, (2.0, 0, 0, 0), (0,) * 4)
    assert lease.apply(smaller, redis.now, redis.now, durable=False)  # shrank: confirmed at once
    assert lease.inflight.share == 2 < grown
    redis.now = lease.valid_until  # only unacknowledged renewals since: the lease lapses
    assert not lease.apply(redis.renew("m", lease), redis.now - 0.1, redis.now, durable=False)
    assert lease.state is FleetState.HOLDING


def test_a_replica_whose_clients_left_asks_for_nothing_a_period_later() -> None:
    """Its share refused six clients with short hints, then they went elsewhere: the next full
    period reports no waiting demand (no memory that outlives the hints)."""
    redis = LuaRedis()
    lease = FleetLease(FleetPolicy(max_inflight=8), hints(), redis.now)
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    grants: list[Grant] = []
    offer(redis, lease, 6, lease.policy.renew_s, grants)
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    assert lease.inflight.want > 1
    for grant in grants:
        lease.release(grant, executed=True)
    redis.now += lease.policy.renew_s
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    redis.now += lease.policy.renew_s
    lease.apply(redis.renew("m", lease), redis.now, redis.now)
    assert lease.inflight.want == 0


def test_a_hash_redis_lost_grows_no_share_until_every_live_replica_has_renewed() -> None:
    """Redis restarted empty (or the key was flushed): the first replica to renew finds nobody
    holding anything, but it held a lease, so the hash was lost. For a lease and a half no share
    grows past what its replica applies or holds, however much it wants, so b, whose requests
    still run, is not overrun; then shares follow demand."""
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=8, hold_s=0.5, max_request_s=1.0)
    a, b = FleetLease(policy, hints(), redis.now), FleetLease(policy, hints(), redis.now)
    held: dict[str, list[Grant]] = {"a": [], "b": []}
    for _ in range(8):
        for name, lease in (("a", a), ("b", b)):
            offer(redis, lease, 4 - len(held[name]), policy.renew_s, held[name])
        renew_all(redis, {"a": a, "b": b})
    assert len(held["a"]) == len(held["b"]) == 4
    redis.hash.clear()
    for grant in held["a"][:2]:
        a.release(grant, executed=True)
    more: list[Grant] = []
    start = redis.now
    while redis.now < start + 1.5 * policy.lease_s - policy.renew_s:
        offer(redis, a, 8, policy.renew_s, more)  # a wants the whole cap
        renew_all(redis, {"a": a, "b": b})
        assert a.inflight.share <= 4 and a.inflight.holding + b.inflight.holding <= 8
    for grant in held["b"]:  # b's requests end: past the freeze, a's demand is met
        b.release(grant, executed=True)
    for _ in range(4):
        offer(redis, a, 8, policy.renew_s, more)
        renew_all(redis, {"a": a, "b": b})
    assert a.inflight.share > 4


def test_a_new_fleet_grows_no_share_in_its_first_lease_only() -> None:
    """A hash nobody had a lease in: its replicas hold nothing yet, so the first lease is all the
    freeze lasts."""
    redis = LuaRedis()
    redis.hash.clear()
    lease = FleetLease(FleetPolicy(max_inflight=8), hints(), redis.now)
    grants: list[Grant] = []
    start = redis.now
    while lease.inflight.share < 6:
        offer(redis, lease, 6 - len(grants), lease.policy.renew_s, grants)
        renew_all(redis, {"m": lease})
        assert redis.now - start <= lease.policy.lease_s + 2 * lease.policy.renew_s
    assert redis.now - start >= lease.policy.lease_s


def test_a_step_of_redis_clock_ahead_never_ends_a_cut_off_replicas_reservation_before_its_cut() -> None:
    """The holder is cut off from Redis with five requests running (it cancels them at its cut);
    Redis's clock jumps an hour ahead while the taker renews every 50 ms wanting the whole cap.
    The jump moves the fleet's clock no further than the time that passed: until its cut, the
    two never hold more than 8."""
    redis, policy, holder, taker = holder_and_taker()
    assert holder.cut_at is not None
    redis.step = 3600.0
    took: list[Grant] = []
    while redis.now < holder.cut_at:
        offer(redis, taker, 8 - len(took), 0.05, took)
        renew_all(redis, {"taker": taker})
        assert taker.inflight.holding + holder.inflight.holding <= 8, holder.cut_at - redis.now


def test_steps_of_redis_clock_again_and_again_never_end_a_cut_off_replicas_reservation_before_its_cut() -> None:
    """As above, but Redis's clock steps an hour ahead or back between every two renewals of the
    taker (what the state machine found: each step ahead used to move the fleet's clock half a
    lease, and the reservation outlasts the holder's cut by one such half lease only)."""
    redis, policy, holder, taker = holder_and_taker()
    assert holder.cut_at is not None
    took: list[Grant] = []
    steps = 0
    while redis.now < holder.cut_at:
        steps += 1
        redis.step += 3600.0 if steps % 3 else -3600.0
        offer(redis, taker, 8 - len(took), 0.05, took)
        renew_all(redis, {"taker": taker})
        assert taker.inflight.holding + holder.inflight.holding <= 8, holder.cut_at - redis.now


def test_a_hash_restored_from_an_old_snapshot_grows_no_share_until_every_live_replica_has_renewed() -> None:
    """Redis restarts from a dump a minute old: its entries look current to the fleet's clock,
    but Redis's own clock shows nobody renewed for more than half a lease, so no share grows past
    what its replica applies until every live one has renewed: b, whose load came back first,
    does not take what a (still leased, its requests running) holds."""
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=8, renew_s=0.25, lease_s=1.0)
    a, b = FleetLease(policy, hints(), redis.now), FleetLease(policy, hints(), redis.now)
    ga: list[Grant] = []
    gb: list[Grant] = []

    def period(na: int, nb: int) -> None:
        offer(redis, a, na - len(ga), policy.renew_s, ga)
        offer(redis, b, nb - len(gb), 0.0, gb)
        renew_all(redis, {"a": a, "b": b})

    for _ in range(12):
        period(2, 6)
    snapshot = dict(redis.hash)
    redis.now += 60  # the load moves during the next minute
    for _ in range(40):
        while len(gb) > 2:
            b.release(gb.pop(), executed=True)
        period(6, 2)
    assert a.inflight.holding == 6
    redis.hash = snapshot  # the restart, loading the dump
    for _ in range(4):  # b's load comes back first, and it renews before a
        offer(redis, b, 6 - len(gb), 0.05, gb)
        b.apply(redis.renew("b", b), redis.now, redis.now)
        assert a.inflight.holding + b.inflight.holding <= 8


def test_a_replica_renews_early_to_give_back_only_what_it_does_not_use() -> None:
    """In a contended fleet, a share of 6 held by nobody and awaited by nobody is given back at
    once (an early renewal); a share of one, the least a replica that wants any keeps, is not
    (renewing would change nothing), nor a share whose clients wait for it."""
    lease = FleetLease(FleetPolicy(max_inflight=8), hints(), 0.0)
    share = lease.inflight
    share.limit, share.fleet_want = 8, 12.0  # contended as of the last reply
    lease.state = FleetState.LEASED
    share.set_share(6.0, 0.0)
    assert lease.giving_back(0.0)
    share.set_share(1.0, 0.0)
    assert not lease.giving_back(0.0)
    share.set_share(6.0, 0.0)
    share.refuse(0.0, 5, 500)  # five clients told to come back in 500 ms
    assert not lease.giving_back(0.1)
    assert lease.giving_back(0.6)  # they did not come back
    share.fleet_want = 6.0  # uncontended: nobody waits for it
    assert not lease.giving_back(0.6)
