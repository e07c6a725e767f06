"""The fleet lease: lease.lua run by a Lua 5.1 interpreter (lupa, as Redis runs it) over a
dict with a simulated clock, renewing real `FleetLease` objects; no Redis, no sockets."""

from __future__ import annotations

import heapq
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from lupa import lua51

from governor.admission.cost import Ask
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.config import GovernorConfig
from governor.fleet.lease import LEASE_SCRIPT, RESOURCES, FleetLease, FleetPolicy, FleetState, LeaseReply
from governor.fleet.member import redacted
from govwire.errors import OverBudget
from govwire.options import ConfigError
from tests.fakes import make_state

KEY = "fleet:leases"


class LuaRedis:
    """The commands lease.lua calls, over a dict; `now` (seconds) is what TIME answers."""

    def __init__(self) -> None:
        self.lua = lua51.LuaRuntime()
        self.hash: dict[str, str] = {}
        self.now = 1000.0
        self._script = self.lua.execute(f"return function(KEYS, ARGV, redis)\n{LEASE_SCRIPT}\nend")
        self._redis = self.lua.table_from({"call": self._call})

    def _call(self, command: str, *args: str) -> Any:
        if command == "TIME":
            micros = round(self.now * 1e6)
            return self.lua.table_from([str(micros // 1_000_000), str(micros % 1_000_000)])
        if command == "HGETALL":
            return self.lua.table_from([x for pair in self.hash.items() for x in pair])
        if command == "HDEL":
            return int(self.hash.pop(args[1], None) is not None)
        if command == "HSET":
            self.hash[args[1]] = args[2]
            return 1
        if command == "PEXPIRE":
            return 1
        raise AssertionError(f"lease.lua called {command}")

    def renew(self, member: str, lease: FleetLease) -> LeaseReply:
        """What FleetMember.renew sends, run at `now`."""
        lease.next_renewal = self.now + lease.policy.renew_s
        args = [member, round(lease.policy.lease_s * 1000), len(RESOURCES), *lease.report(self.now)]
        raw = self._script(self.lua.table_from([KEY]), self.lua.table_from([str(a) for a in args]), self._redis)
        return LeaseReply.parse(list(raw.values()))

    def held(self, resource: int) -> float:
        """The sum of what Redis keeps reserved for every entry (expired or not)."""
        return sum(float(value.split()[1 + 4 * resource + 3]) for value in self.hash.values())


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
    reach the replica later (admissions and releases happen in between); replicas die; the clock
    moves, never so far that a live replica's entry expires (that is a partition, where the cap is
    knowingly given up: docs/operations.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.redis = LuaRedis()
        self.policy = FleetPolicy(max_inflight=7, max_qps=50.0, qps_burst=10.0, renew_s=0.25, lease_s=1.0)
        start = self.redis.now
        self.leases = [FleetLease(self.policy, hints(), start) for _ in range(3)]
        self.alive = [True] * 3
        self.grants: list[list[Grant]] = [[], [], []]
        self.pending: list[tuple[LeaseReply, float] | None] = [None] * 3
        for i in range(3):  # joined, as `serve` does before it listens
            self.deliver_now(i)

    def deliver_now(self, i: int) -> None:
        reply = self.redis.renew(f"m{i}", self.leases[i])
        self.leases[i].granted(reply, self.redis.now, self.redis.now)

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
        if self.alive[i] and self.pending[i] is None:
            self.pending[i] = (self.redis.renew(f"m{i}", self.leases[i]), self.redis.now)

    @rule(i=st.integers(0, 2))
    def deliver(self, i: int) -> None:
        pending = self.pending[i]
        if pending is not None:
            self.pending[i] = None
            reply, sent = pending
            if self.leases[i].granted(reply, sent, self.redis.now):
                self.send(i)  # the confirming renewal FleetMember sends at once
                self.deliver(i)

    @precondition(lambda self: sum(self.alive) > 1)
    @rule(i=st.integers(0, 2))
    def kill(self, i: int) -> None:
        self.alive[i] = False
        self.grants[i] = []  # its requests died with it
        self.pending[i] = None

    @rule(dt=st.floats(0.001, 0.3))
    def advance(self, dt: float) -> None:
        live = [lease.valid_until for lease, alive in zip(self.leases, self.alive, strict=True) if alive]
        if self.redis.now + dt < min(live):
            self.redis.now += dt

    @invariant()
    def grants_never_sum_over_the_limits(self) -> None:
        live = [lease for lease, alive in zip(self.leases, self.alive, strict=True) if alive]
        assert sum(lease.inflight.holding for lease in live) <= self.policy.max_inflight
        assert sum(lease.inflight.share for lease in live) <= self.policy.max_inflight
        assert sum(lease.qps.share for lease in live) <= self.policy.max_qps + 1e-9
        banked = sum(lease.qps.bucket.level(self.redis.now) for lease in live if lease.qps.bucket is not None)
        assert banked <= self.policy.qps_burst + 1e-9  # with the rates: <= burst + rate x T over any window
        assert self.redis.held(0) <= self.policy.max_inflight + 1e-9

    @invariant()
    def nothing_lapses_while_renewed(self) -> None:
        assert all(
            lease.state is FleetState.LEASED for lease, alive in zip(self.leases, self.alive, strict=True) if alive
        )


Fleet.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestFleet = Fleet.TestCase


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
        if lease.granted(redis.renew(member, lease), redis.now, redis.now):
            lease.granted(redis.renew(member, lease), redis.now, redis.now)


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
    for _ in range(16):  # 4 s: the memory of how many waited (lease.WAITING_MEMORY_S) fades
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


def test_a_dead_replicas_share_returns_after_its_lease() -> None:
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=30, renew_s=0.25, lease_s=1.0)
    leases = {f"m{i}": FleetLease(policy, hints(), redis.now) for i in range(3)}
    renew_all(redis, leases)
    dead = leases.pop("m0")
    grants: list[Grant] = []
    while len(grants) < 10:  # its load: 10 requests, held until it dies
        offer(redis, dead, 10 - len(grants), policy.renew_s, grants)
        renew_all(redis, {"m0": dead, **leases})
    survivor, held = leases["m1"], []  # the survivor wants everything; m2 nothing
    waited = 0.0
    while survivor.inflight.share < 30:
        offer(redis, survivor, 30 - len(held), policy.renew_s, held)
        waited += policy.renew_s
        renew_all(redis, leases)
        assert waited <= policy.lease_s + policy.renew_s, survivor.describe()
    assert "m0" not in redis.hash  # dropped by the first renewal past its expiry
    assert waited > policy.lease_s - policy.renew_s  # not before it expired: its slots were held


# --- this replica's side -------------------------------------------------------------------------


def test_after_a_failed_join_and_after_a_lapse_the_fallback_applies() -> None:
    local = FleetLease(FleetPolicy(max_inflight=9, max_qps=30.0), hints(), 0.0)
    assert local.state is FleetState.JOINING and local.inflight.share == 0
    local.lapse(0.0)  # the first renewal failed
    assert local.state is FleetState.JOINING and local.inflight.share == 9  # the limit / 1 replica
    closed = FleetLease(FleetPolicy(max_inflight=9, unavailable="closed"), hints(), 0.0)
    closed.lapse(0.0)
    refusal = closed.check(0.0, Ask())
    assert isinstance(refusal, Refusal) and refusal.reason == "fleet_unavailable"

    redis = LuaRedis()
    other = FleetLease(local.policy, hints(), redis.now)
    renew_all(redis, {"local": local, "other": other})
    renew_all(redis, {"local": local, "other": other})
    assert local.state is FleetState.LEASED and local.replicas == 2
    assert local.check(redis.now + 0.5, Ask()) is None
    local.lapse(redis.now + 0.99)
    assert local.state is FleetState.LEASED
    local.lapse(redis.now + 1.0)  # the lease ran out: each cap over the 2 replicas last seen
    assert local.state is FleetState.LOCAL and local.inflight.share == 4 and local.qps.share == 15.0


def test_a_reply_later_than_the_lease_it_renews_grants_nothing() -> None:
    redis = LuaRedis()
    lease = FleetLease(FleetPolicy(max_inflight=4, unavailable="closed"), hints(), redis.now)
    reply = redis.renew("m", lease)
    assert not lease.granted(reply, redis.now, redis.now + 1.0)
    assert lease.state is FleetState.JOINING and lease.closed


def test_refusals_name_the_fleet_limit_and_hint_at_the_refill_or_the_renewal() -> None:
    redis = LuaRedis()
    policy = FleetPolicy(max_inflight=4, max_qps=10.0, qps_burst=4.0)
    lease = FleetLease(policy, hints(), redis.now)
    lease.granted(redis.renew("m", lease), redis.now, redis.now)
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
    zero.granted(
        LeaseReply(3, (0.0, 0.0, 0.0, 0.0), (4, 10, 0, 0), (4, 0, 0, 0), (9, 20, 0, 0), (0, 0, 0, 0)), now, now
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
    lease.granted(LeaseReply(2, (2, 0, 100, 0), (4, 0, 200, 0), (0,) * 4, (0,) * 4, (2, 0, 100, 0)), 0.0, 0.0)
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
    empty.granted(LeaseReply(2, (0, 0, 0, 0), (4, 0, 0, 0), (0,) * 4, (0,) * 4, (0, 0, 0, 0)), 0.0, 0.0)
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
    lease.granted(LeaseReply(2, (0, 500, 100, 500), (0, 0, 200, 1000), (0,) * 4, (0,) * 4, (0, 500, 100, 500)), 0, 0)
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
    ],
)
def test_fleet_configuration_errors(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GovernorConfig(**flags)


def test_urls_are_logged_without_their_password() -> None:
    assert redacted("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://app:s3cret@redis:6380/1") == "rediss://app:***@redis:6380/1"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"


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
