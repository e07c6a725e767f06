"""Tenants and priority classes through the ingress on a simulated clock: who a frame is for, each
tenant's own caps, fair shares near saturation, class ceilings; refusals leave no trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.admission.cost import Ask
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.fair_share import CONTENDING_S
from governor.admission.hints import RetryHintPolicy
from governor.admission.limits import Grant
from governor.admission.priority import CeilingPolicy
from governor.admission.tenant import TenantLimits, parse_tenant
from governor.doors.ndjson import Ingress
from governor.lifecycle import InflightRequest
from governor.shell.config import GovernorConfig
from governor.shell.config_file import read_config_file
from governor.state import ServerState
from govwire.auth import SharedSecret, TenantSecrets
from govwire.codec import encode, generate_frame
from govwire.options import ConfigError
from govwire.vocab import DEFAULT_TENANT, Priority, YieldReason
from tests.fakes import (
    FakeClock,
    FakeTimers,
    FakeUpstream,
    done_frame,
    make_ingress,
    make_state,
    unspent,
    worker_sends,
)


def frame(rid: str, prompt: str = "hi", **fields: Any) -> bytes:
    return encode(generate_frame(rid, prompt, **fields))


def replies(writes: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in writes.lines()]


def finish(state: ServerState, request: InflightRequest, prompt_tokens: int = 1, completion_tokens: int = 1) -> None:
    worker_sends(
        state, done_frame(request.uid, "", "eos", prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    )


def finish_as_reserved(state: ServerState, request: InflightRequest) -> None:
    """It ends having used what it reserved: its tenant's fair-share counter is not corrected."""
    ask = request.grant.ask
    finish(state, request, ask.prompt_tokens, ask.max_new_tokens)


# -- identity --------------------------------------------------------------------------------------


def test_the_token_file_maps_secrets_to_tenants_and_a_lone_secret_to_the_default() -> None:
    secrets = TenantSecrets.from_text("# comment\n\nalpha s3cret-a\nbeta  s3cret-b\nlone-secret\n", "f")
    assert secrets.tenants == {"alpha", "beta", DEFAULT_TENANT}
    assert [secrets.tenant_of(t) for t in ("s3cret-a", "s3cret-b", "lone-secret", "nope", 7)] == [
        "alpha",
        "beta",
        DEFAULT_TENANT,
        None,
        None,
    ]
    assert "s3cret" not in repr(secrets)
    for bad, why in (
        ("a b c\n", "SECRET or TENANT SECRET"),
        ("bad/name s\n", "a tenant is"),
        ("a s\nb s\n", "twice"),
        ("# nothing\n", "empty"),
    ):
        with pytest.raises(ValueError, match=why):
            TenantSecrets.from_text(bad, "f")


def test_an_authenticated_connection_cannot_act_as_another_tenant() -> None:
    secrets = TenantSecrets.from_text("alpha sa\nbeta sb\n", "f")
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, upstream=upstream, auth=secrets)
    ingress, writes = make_ingress(state)
    ingress.receive_data(b'{"op": "auth", "token": "sa"}\n')
    assert ingress.tenant == "alpha"
    ingress.receive_data(frame("x", tenant="beta") + frame("y", tenant="alpha") + frame("z"))
    out = replies(writes)
    assert [(r["status"], r.get("code"), r.get("id")) for r in out] == [
        ("authenticated", None, None),
        ("error", "tenant_mismatch", "x"),
    ]
    tenants = {t.name: t for t in state.admission.tenants}
    assert (tenants["alpha"].inflight, tenants["beta"].tally.admitted, tenants["beta"].tally.yielded_total) == (2, 0, 0)
    # A later auth frame with the other tenant's secret cannot switch the connection's identity.
    ingress.receive_data(b'{"op": "auth", "token": "sb", "id": "again"}\n')
    assert replies(writes)[-1]["code"] == "tenant_mismatch" and ingress.tenant == "alpha" and not ingress.closing
    assert state.accounting.rejected["tenant_mismatch"] == 2


def test_under_tenant_from_frame_the_field_names_the_tenant_and_unknown_names_are_the_default() -> None:
    state = make_state(max_inflight=8, tenants={"alpha": TenantLimits(max_inflight=1)}, tenant_from_frame=True)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", tenant="alpha") + frame("b", tenant="alpha") + frame("c", tenant="stranger"))
    assert [r.get("reason") for r in replies(writes)] == [YieldReason.TENANT_INFLIGHT]
    tenants = {t.name: t for t in state.admission.tenants}
    assert (tenants["alpha"].inflight, tenants[DEFAULT_TENANT].inflight) == (1, 1)
    assert tenants["alpha"].tally.yielded[YieldReason.TENANT_INFLIGHT] == 1
    ingress.receive_data(frame("d", tenant=["not", "a", "name"]))  # admitted as the default, then refused
    assert replies(writes)[-1]["code"] == "bad_frame" and tenants[DEFAULT_TENANT].inflight == 1


def test_tenants_come_from_flags_and_config_tables(tmp_path: Any) -> None:
    assert parse_tenant("batch,weight=0.5,max_inflight=4,max_tokens_per_s=100") == (
        "batch",
        TenantLimits(weight=0.5, max_inflight=4, max_tokens_per_s=100.0),
    )
    for bad in ("x y", "a,weight=0", "a,color=red", "a,max_qps=fast", "a,qps_burst=0.5"):
        with pytest.raises(ValueError):
            parse_tenant(bad)
    path = tmp_path / "governor.toml"
    path.write_text('[[tenant]]\nname = "interactive"\nweight = 3\nmax_inflight = 8\n[[tenant]]\nname = "batch"\n')
    values = read_config_file(str(path))
    config = GovernorConfig(**values)
    assert config.tenant_limits() == {"interactive": TenantLimits(weight=3.0, max_inflight=8), "batch": TenantLimits()}
    with pytest.raises(ConfigError, match="listed twice"):
        GovernorConfig(tenant=("a", "a,weight=2"))
    path.write_text('[[tenant]]\nname = "x"\ncolour = 1\n')
    with pytest.raises(ConfigError, match="tenant 1 needs"):
        read_config_file(str(path))
    with pytest.raises(ConfigError, match="ceilings"):
        GovernorConfig(sheddable_ceiling=0.99, standard_ceiling=0.9)


# -- caps, shares, classes -------------------------------------------------------------------------


def test_a_tenant_cap_and_its_hint() -> None:
    clock = FakeClock()
    state = make_state(
        max_inflight=8,
        clock=clock,
        hint_policy=RetryHintPolicy(jitter=0.0),
        tenants={"a": TenantLimits(max_qps=10.0, qps_burst=1.0)},
        tenant_from_frame=True,
    )
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("1", tenant="a") + frame("2", tenant="a") + frame("3", tenant="a"))
    # The bucket's exact refill, booked one after another.
    assert [(r["reason"], r["retry_hint_ms"]) for r in replies(writes)] == [("tenant_qps", 100), ("tenant_qps", 200)]
    clock.advance(0.1)
    ingress.receive_data(frame("2", tenant="a"))
    assert state.admission.tenants.resolve("a").inflight == 2


def test_a_request_larger_than_its_tenants_budget_is_over_budget() -> None:
    state = make_state(max_inflight=4, tenants={"a": TenantLimits(max_inflight_tokens=20)}, tenant_from_frame=True)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("big", "x" * 40, max_new_tokens=16, tenant="a"))  # 10 + 16 > 20
    (reply,) = replies(writes)
    assert (reply["code"], reply["id"]) == ("over_budget", "big") and "tenant a's max_inflight_tokens" in reply[
        "message"
    ]


def test_a_lone_tenant_uses_every_slot_and_never_yields_for_its_share() -> None:
    state = make_state(max_inflight=4, tenants={"a": TenantLimits(), "b": TenantLimits()}, tenant_from_frame=True)
    ingress, writes = make_ingress(state)
    ingress.receive_data(b"".join(frame(str(i), tenant="a") for i in range(6)))
    assert [r["reason"] for r in replies(writes)] == ["inflight", "inflight"]
    assert state.admission.inflight.inflight == 4


def test_past_the_threshold_the_tenant_ahead_yields_and_the_one_behind_gets_in() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(
        max_inflight=10,
        clock=clock,
        upstream=upstream,
        tenants={"a": TenantLimits(), "b": TenantLimits()},
        tenant_from_frame=True,
        share_threshold=0.5,
    )
    a, a_writes = make_ingress(state)
    b, b_writes = make_ingress(state)
    a.receive_data(b"".join(frame(f"a{i}", tenant="a") for i in range(12)))  # a alone: all 10 slots
    assert len(a.active) == 10 and not state.accounting.yielded[YieldReason.TENANT_SHARE]
    b.receive_data(frame("b0", tenant="b"))  # full: b is refused, contends, and is lifted to a's counter
    assert replies(b_writes)[-1]["reason"] == "inflight"
    assert state.admission.tenants.resolve("b").service == state.admission.tenants.resolve("a").service
    for request in list(a.active.values())[:4]:
        finish(state, request, 1, 16)  # settled at what they reserved ("hi": 1 token, + 16): 6 in flight
    a.receive_data(frame("a-more", tenant="a") + frame("a-again", tenant="a"))  # even, then a is ahead
    assert replies(a_writes)[-1]["reason"] == YieldReason.TENANT_SHARE and len(a.active) == 7
    b.receive_data(b"".join(frame(f"b{i}", tenant="b") for i in range(1, 4)))  # b catches up, and passes a
    assert len(b.active) == 2 and replies(b_writes)[-1]["reason"] == YieldReason.TENANT_SHARE
    a.receive_data(frame("a-again", tenant="a"))  # a's turn: the last slot
    assert len(a.active) == 8 and state.admission.inflight.inflight == 10
    # Once nobody else contends (b stops asking), a gets everything again.
    for request in list(b.active.values()):
        finish(state, request, 1, 16)
    clock.advance(CONTENDING_S + 0.1)
    a.receive_data(b"".join(frame(f"a-later{i}", tenant="a") for i in range(4)))
    assert state.admission.inflight.inflight == 10 and replies(a_writes)[-1]["reason"] == "inflight"


def test_class_ceilings_are_gates_closed_only_while_a_higher_class_is_refused() -> None:
    # Fixed hints: no appointment keeps a slot for the refused critical frame, the gates alone act.
    clock = FakeClock()
    state = make_state(
        max_inflight=10,
        clock=clock,
        ceilings=CeilingPolicy(0.5, 0.8, hold_s=5.0),
        preempt=False,
        hint_policy=RetryHintPolicy(adaptive=False),
    )
    ingress, writes = make_ingress(state)
    admission = state.admission
    # Sheddable and critical traffic with room for all: nobody is refused, every slot is usable.
    ingress.receive_data(b"".join(frame(f"s{i}", priority="sheddable") for i in range(8)))
    ingress.receive_data(b"".join(frame(f"c{i}", priority="critical") for i in range(2)))
    assert admission.inflight.inflight == 10 and not replies(writes)
    assert state.snapshot()["classes"]["sheddable"]["ceiling"] == 1.0
    # A critical frame meets the full cap (no displacement: --preempt off): the gates close.
    ingress.receive_data(frame("c2", priority="critical"))
    assert [r["reason"] for r in replies(writes)] == ["inflight"]
    assert state.snapshot()["classes"]["sheddable"]["ceiling"] == 0.5
    assert state.snapshot()["classes"]["standard"]["ceiling"] == 0.8
    for request in [r for r in ingress.active.values() if r.client_id.startswith("s")][:3]:
        finish(state, request)
    assert admission.inflight.inflight == 7
    # Three slots free, and still only for the classes above: sheddable stops at 50%, standard at 80%.
    ingress.receive_data(frame("s8", priority="sheddable"))
    ingress.receive_data(b"".join(frame(f"t{i}", priority="standard") for i in range(2)))
    assert admission.inflight.inflight == 8 and "t0" in ingress.active and "t1" not in ingress.active
    ingress.receive_data(b"".join(frame(f"c{i}", priority="critical") for i in range(3, 5)))
    assert admission.inflight.inflight == 10  # critical goes to the hard cap
    classes = state.accounting.classes
    assert [classes[p].inflight for p in Priority] == [4, 1, 5]  # critical, standard, sheddable
    # No higher-class refusal for hold_s: the gates open, whatever classes were seen.
    clock.advance(5.1)
    assert state.snapshot()["classes"]["sheddable"]["ceiling"] == 1.0
    for request in list(ingress.active.values())[:2]:
        finish(state, request)
    ingress.receive_data(b"".join(frame(f"s{i}", priority="sheddable") for i in range(9, 11)))
    assert admission.inflight.inflight == 10 and classes[Priority.SHEDDABLE].inflight >= 5


# -- properties ------------------------------------------------------------------------------------


class TenantMachine(RuleBasedStateMachine):
    """Frames of three tenants (one with every cap) and three classes, completions with real
    counts, disconnects and time passing, over a global cap, a global token budget and fair shares."""

    MAX_INFLIGHT = 8
    BUDGET = 400
    CAPS = TenantLimits(
        weight=2.0, max_inflight=3, max_qps=4.0, qps_burst=2.0, max_inflight_tokens=150, max_tokens_per_s=80.0
    )
    THRESHOLD = 0.5
    ALLOWANCE = 3  # critical frames' allowance past the cap (more than the guarantee: both act)
    CEILINGS = CeilingPolicy(0.6, 0.85, hold_s=1.0, critical_allowance=ALLOWANCE)
    GUARANTEED = 2  # plain's guaranteed_inflight

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.upstream = FakeUpstream()
        self.state = make_state(
            max_inflight=self.MAX_INFLIGHT,
            clock=self.clock,
            upstream=self.upstream,
            timers=FakeTimers(self.clock),
            max_inflight_tokens=self.BUDGET,
            tenants={"capped": self.CAPS, "plain": TenantLimits(weight=1.0, guaranteed_inflight=self.GUARANTEED)},
            tenant_from_frame=True,
            share_threshold=self.THRESHOLD,
            ceilings=self.CEILINGS,
        )
        self.conns: list[Ingress] = [make_ingress(self.state)[0] for _ in range(2)]
        self.n = 0

    def tenant(self, name: str) -> Any:
        return self.state.admission.tenants.resolve(name)

    def live(self) -> list[InflightRequest]:
        return [r for c in self.conns for r in c.active.values()]

    def snapshot(self) -> tuple[Any, ...]:
        a, acc = self.state.admission, self.state.accounting
        now = self.clock()
        tenants = [
            (
                t.name,
                t.inflight,
                t.tokens,
                unspent(t.qps_bucket, t.qps_book, now),
                unspent(t.token_bucket, t.token_rate_book, now),
                t.tally.admitted,
                t.tally.settled,
                t.tally.tokens_settled,
            )
            for t in a.tenants
        ]
        classes = [(p, c.admitted, c.settled) for p, c in acc.classes.items()]
        return (a.inflight.inflight, a.tokens.held, acc.tokens_reserved, acc.executed, tenants, classes)

    @rule(
        conn=st.integers(0, 1),
        who=st.sampled_from(["capped", "plain", "stranger", None]),
        priority=st.sampled_from([None, "critical", "standard", "sheddable"]),
        chars=st.integers(0, 240),
        max_new=st.integers(1, 40),
    )
    def send(self, conn: int, who: str | None, priority: str | None, chars: int, max_new: int) -> None:
        self.n += 1
        fields: dict[str, Any] = {"max_new_tokens": max_new}
        if who is not None:
            fields["tenant"] = who
        if priority is not None:
            fields["priority"] = priority
        admission = self.state.admission
        ask = self.state.costs.ask({"prompt": "p" * chars, "max_new_tokens": max_new})
        usage = admission.fair.usage(1, ask.cost)
        admission.appointments.tidy(self.clock())  # (lapses give back before, not during, the frame)
        lent_bound = self.loan_bound(who)
        before = self.snapshot()
        yielded = dict(self.state.accounting.yielded)
        rejected = self.state.accounting.rejected_total
        ingress = self.conns[conn]
        ingress.receive_data(frame(f"r{self.n}", "p" * chars, **fields))
        request = ingress.active.get(f"r{self.n}")
        if request is None:
            if self.state.accounting.yielded != yielded or self.state.accounting.rejected_total != rejected:
                # A refusal leaves no trace on any count or capacity (a rate cap's appointment moves
                # its tokens from the bucket into its book: what is unspent stays the same).
                assert self.snapshot() == before
            if self.state.accounting.yielded[YieldReason.TENANT_SHARE] != yielded[YieldReason.TENANT_SHARE]:
                assert usage > self.THRESHOLD  # with room left nobody yields for its share
            return
        # Admitted: under its class's ceiling of every cap (when the ceiling applied).
        ceiling = request.grant.ask.ceiling
        assert ceiling in (1.0, self.CEILINGS.sheddable, self.CEILINGS.standard)
        tenant = request.grant.ask.tenant
        if admission.inflight.inflight > self.MAX_INFLIGHT * ceiling + 1e-9:  # within a guarantee or the allowance
            guaranteed = tenant is not None and tenant.name == "plain" and tenant.inflight <= self.GUARANTEED
            allowed = priority == "critical" and admission.inflight.inflight <= self.MAX_INFLIGHT + self.ALLOWANCE
            # lent past the cap: its tenant under its share, by no more than the others over theirs hold past them
            lent = lent_bound is not None and admission.inflight.inflight <= self.MAX_INFLIGHT + lent_bound
            assert guaranteed or allowed or lent
        assert admission.tokens.held <= self.BUDGET * ceiling + 1e-9
        assert tenant is not None and tenant.name == (who if who in ("capped", "plain") else DEFAULT_TENANT)
        if tenant.name == "capped":
            assert tenant.inflight <= self.CAPS.max_inflight * ceiling + 1e-9
            assert tenant.tokens <= self.CAPS.max_inflight_tokens * ceiling + 1e-9

    def loan_bound(self, who: str | None) -> float | None:
        """How far past the cap a frame of `who` may be lent a slot now (FairShare.lends): what the
        contending tenants over their shares hold, when `who` is under its share (its counter the
        lowest); None when no loan would be made."""
        admission = self.state.admission
        now = self.clock()
        ask = Ask()
        ask.tenant = admission.tenants.resolve(who)
        if len(admission.tenants) < 2 or not admission.fair.lends(now, ask):
            return None
        lowest, _, _ = admission.fair.floor(now)
        assert ask.tenant.service <= lowest and ask.tenant.inflight < self.MAX_INFLIGHT
        return sum(
            max(0, t.inflight - t.limits.guaranteed_inflight)
            for t in admission.tenants
            if t is not ask.tenant and t.contending_until > now and t.service > lowest
        )

    @precondition(lambda self: self.live())
    @rule(data=st.data(), prompt_tokens=st.integers(0, 60), completion=st.integers(0, 40))
    def worker_finishes_one(self, data: st.DataObject, prompt_tokens: int, completion: int) -> None:
        request = data.draw(st.sampled_from(self.live()))
        finish(self.state, request, prompt_tokens, min(completion, request.grant.ask.max_new_tokens))

    @rule(conn=st.integers(0, 1))
    def disconnect(self, conn: int) -> None:
        self.conns[conn].connection_lost()
        self.conns[conn] = make_ingress(self.state)[0]

    @rule(seconds=st.floats(0, 1.5))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def caps_hold_and_every_tenant_holds_what_its_live_requests_reserved(self) -> None:
        live = self.live()
        admission, acc = self.state.admission, self.state.accounting
        assert admission.inflight.inflight == len(live) <= self.MAX_INFLIGHT + max(self.GUARANTEED, self.ALLOWANCE)
        assert admission.tokens.held <= self.BUDGET
        for tenant in admission.tenants:
            mine = [r for r in live if r.grant.ask.tenant is tenant]
            assert tenant.inflight == tenant.tally.inflight == len(mine)
            assert tenant.tokens == sum(r.grant.ask.cost for r in mine)
        capped = self.tenant("capped")
        assert capped.inflight <= self.CAPS.max_inflight and capped.tokens <= self.CAPS.max_inflight_tokens
        for priority, tally in acc.classes.items():
            assert tally.inflight == sum(1 for r in live if r.grant.ask.priority is priority)
        assert acc.unbalanced_by(admission.inflight.inflight) == 0
        assert sum(t.tally.admitted for t in admission.tenants) == sum(c.admitted for c in acc.classes.values())
        assert sum(t.tally.yielded_total for t in admission.tenants) == acc.yielded_total

    def teardown(self) -> None:
        for conn in self.conns:
            conn.connection_lost()
        assert all(t.inflight == 0 and t.tokens == 0 for t in self.state.admission.tenants)


TestTenantMachine = TenantMachine.TestCase
TestTenantMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class FloodMachine(RuleBasedStateMachine):
    """Two tenants of weight 1 over a cap of 4 and `--tenant-loan 2`, one of them flooding:
    frames, completions and time passing in any order. Past the cap only by a loan
    (FairShare.lends) to a tenant under its share, by no more than the other holds; never past the
    cap + the loan; every frame answered once."""

    CAP = 4
    LOAN = 2

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = make_state(
            max_inflight=self.CAP,
            clock=self.clock,
            timers=FakeTimers(self.clock),
            tenants={"a": TenantLimits(), "b": TenantLimits()},
            tenant_from_frame=True,
            share_threshold=0.5,
            tenant_loan=self.LOAN,
        )
        self.ingress, self.writes = make_ingress(self.state)
        self.n = 0
        self.lent = 0

    @rule(who=st.sampled_from(["a", "a", "a", "b"]))
    def send(self, who: str) -> None:
        self.n += 1
        admission = self.state.admission
        tenant = admission.tenants.resolve(who)
        others = [t for t in admission.tenants if t is not tenant]
        over = max(0, admission.inflight.inflight + 1 - self.CAP)
        lowest, _, _ = admission.fair.floor(self.clock())
        under = tenant.service <= lowest
        held = sum(t.inflight for t in others)
        self.ingress.receive_data(frame(f"r{self.n}", tenant=who))
        if f"r{self.n}" in self.ingress.active and over:  # admitted past the cap: a loan
            self.lent += 1
            assert under and over <= held

    @precondition(lambda self: self.ingress.active)
    @rule(data=st.data())
    def worker_finishes_one(self, data: st.DataObject) -> None:
        finish_as_reserved(self.state, data.draw(st.sampled_from(list(self.ingress.active.values()))))

    @rule(seconds=st.floats(0, 0.5))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def bounded_and_answered_once(self) -> None:
        admission = self.state.admission
        assert admission.inflight.inflight <= self.CAP + self.LOAN
        ids = [r["id"] for r in replies(self.writes) if r["status"] in ("yield", "error", "rejected")]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(self.ingress.active)


TestFloodMachine = FloodMachine.TestCase
TestFloodMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_loan_past_the_cap_happens_in_the_flood_machine() -> None:
    """The property above is not vacuous: a run of its rules that lends."""
    machine = FloodMachine()
    for _ in range(4):
        machine.send("a")
    machine.send("b")  # refused at the cap: b contends, lifted to a's counter
    finish_as_reserved(machine.state, machine.ingress.active["r1"])
    machine.send("a")  # a takes the slot: now over its share, holding all 4
    machine.send("b")
    assert machine.lent == 1
    machine.bounded_and_answered_once()


def backlogged_run(
    admission: Admission, weights: tuple[float, float], costs: tuple[list[int], list[int]], lives: list[int], steps: int
) -> tuple[list[tuple[float, float]], list[float]]:
    """Two tenants that always want more: every step each offers frames until refused; requests
    live a random number of steps. Returns each step's cumulative admitted cost per tenant and
    the counters' gap after each step."""
    tenants = [admission.tenants.resolve(name) for name in ("a", "b")]
    running: list[tuple[int, Grant]] = []
    admitted = [0.0, 0.0]
    cumulative: list[tuple[float, float]] = []
    gaps: list[float] = []
    for step in range(steps):
        now = step * 0.01
        for i in (step % 2, 1 - step % 2):  # who asks first alternates
            for k in range(50):
                cost = costs[i][(step + k) % len(costs[i])]
                ask = Ask(cost=cost, tenant=tenants[i])
                grant = admission.decide(now, ask)
                if not isinstance(grant, Grant):
                    break
                admitted[i] += cost
                running.append((step + lives[(step + k + i) % len(lives)], grant))
        still = []
        for end, grant in running:
            if end <= step:
                grant.used = grant.ask.cost
                admission.release(grant, executed=True)
            else:
                still.append((end, grant))
        running = still
        cumulative.append((admitted[0], admitted[1]))
        gaps.append(abs(tenants[0].service - tenants[1].service))
    return cumulative, gaps


@settings(max_examples=60, deadline=None)
@given(
    weights=st.sampled_from([(1.0, 1.0), (3.0, 1.0), (1.0, 4.0)]),
    costs_a=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    costs_b=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    lives=st.lists(st.integers(1, 6), min_size=1, max_size=6),
)
def test_two_backlogged_tenants_share_contended_capacity_by_weight_within_the_bound(
    weights: tuple[float, float], costs_a: list[int], costs_b: list[int], lives: list[int]
) -> None:
    """With every admission contended (threshold 0), the counters never differ by more than
    2 * C_max / w_min, and the weighted admitted cost over any window differs by at most twice that."""
    state = make_state(
        max_inflight=6,
        tenants={"a": TenantLimits(weight=weights[0]), "b": TenantLimits(weight=weights[1])},
        share_threshold=0.0,
    )
    cumulative, gaps = backlogged_run(state.admission, weights, (costs_a, costs_b), lives, steps=300)
    bound = 2 * max(costs_a + costs_b) / min(weights)
    assert max(gaps[2:]) <= bound + 1e-9
    weighted = [(a / weights[0], b / weights[1]) for a, b in cumulative]
    for start in range(2, len(weighted), 7):
        for end in range(start + 1, len(weighted), 13):
            served_a = weighted[end][0] - weighted[start][0]
            served_b = weighted[end][1] - weighted[start][1]
            assert abs(served_a - served_b) <= 2 * bound + 1e-9
    # From when both contend (the lift forgave b what a took alone before): the shares follow the weights.
    served_a, served_b = (cumulative[-1][i] - cumulative[2][i] for i in (0, 1))
    assert served_a > 0 and served_b > 0
    assert abs(served_a / weights[0] - served_b / weights[1]) <= 2 * bound + 1e-9


def test_tenants_refused_at_the_cap_are_booked_in_turn_whoever_they_are() -> None:
    """The global cap's refusals book appointments in the order they come, whatever the tenant
    (ordering them by share is the next step, not this one): nobody is told a release that was
    promised to someone else."""
    state = make_state(
        max_inflight=4,
        hint_policy=RetryHintPolicy(jitter=0.0),
        tenants={"a": TenantLimits(), "b": TenantLimits()},
        tenant_from_frame=True,
    )
    state.admission.hints.observe_service_time(0.4)
    a, a_writes = make_ingress(state)
    b, b_writes = make_ingress(state)
    # 4 tokens each at the prior step (100 ms, no stream seen yet): each ends 0.4 s after its admission
    a.receive_data(b"".join(frame(f"a{i}", tenant="a", max_new_tokens=4, stop_on_eos=False) for i in range(8)))
    # the four admitted together end together, 400 ms on: the four refused are told that, less the
    # millisecond by which a holder is told to come early (the lobby, appointments.early_s)
    assert [r["retry_hint_ms"] for r in replies(a_writes)] == [399, 399, 399, 399]
    b.receive_data(
        frame("b0", tenant="b", max_new_tokens=4, stop_on_eos=False)
        + frame("b1", tenant="b", max_new_tokens=4, stop_on_eos=False)
    )
    # b's are the slots' next round: a's appointments (399 ms), 400 ms of service and the 1 ms a
    # holder starts after its appointment, told 1 ms early: 399 + 400 + 1 - 1
    b_replies = replies(b_writes)
    assert [(r["reason"], r["retry_hint_ms"]) for r in b_replies] == [("inflight", 799), ("inflight", 799)]
    assert all(r["retry_ticket"] for r in b_replies)


def test_a_refusal_past_the_horizon_between_tenants_is_final_with_a_hint_past_the_horizon() -> None:
    state = make_state(
        max_inflight=4,
        hint_policy=RetryHintPolicy(jitter=0.0),
        tenants={"a": TenantLimits(), "b": TenantLimits()},
        tenant_from_frame=True,
    )
    state.admission.hints.observe_service_time(0.4)
    a, a_writes = make_ingress(state)
    # 16 tokens each (the default) at the prior step (100 ms): they end 1.6 s on, past the horizon
    a.receive_data(b"".join(frame(f"a{i}", tenant="a", stop_on_eos=False) for i in range(5)))
    (reply,) = replies(a_writes)
    assert reply["final"] and reply["retry_hint_ms"] >= 1000 and "retry_ticket" not in reply


def test_the_shipped_placeholder_secret_is_refused() -> None:
    shipped = yaml.safe_load((Path(__file__).resolve().parents[3] / "deploy/k8s/secret.yaml").read_text())
    for value in shipped["stringData"].values():
        with pytest.raises(ValueError, match="placeholder"):
            SharedSecret.from_text(value, "worker-token")
        with pytest.raises(ValueError, match="placeholder"):
            TenantSecrets.from_text(f"alpha {value}\n", "client-token")


def test_a_tenants_own_cap_books_the_forecast_releases_of_its_own_requests_and_keeps_them() -> None:
    """tenant_inflight: the k-th client refused is told the k-th release of the tenant's own
    requests nobody was promised (be here by: a millisecond before), and the slot is kept for it:
    a newcomer of the tenant is refused while the window is open, the holder admitted."""
    state = make_state(
        max_inflight=32,
        hint_policy=RetryHintPolicy(jitter=0.0),
        tenants={"a": TenantLimits(max_inflight=2)},
        tenant_from_frame=True,
    )
    admission = state.admission
    admission.hints.observe_service_time(0.4)
    tenant = admission.tenants.resolve("a")
    grants = []
    for at in (0.0, 0.1):  # 4 tokens at the prior step (100 ms, no stream seen): they end at 0.4 and 0.5
        grant = admission.decide(at, Ask(tenant=tenant, max_new_tokens=4))
        assert isinstance(grant, Grant)
        grants.append(grant)
    told, booked = [], []
    for _ in range(3):
        refusal = admission.decide(0.1, Ask(tenant=tenant, max_new_tokens=4))
        assert not isinstance(refusal, Grant) and refusal.reason == "tenant_inflight"
        assert refusal.appointment is not None and not refusal.final
        told.append(refusal.hint_ms)
        booked.append(refusal.appointment)
    # its first request's end, its second's, the first slot's next round (a service time, 0.4 s, on)
    assert told == [299, 399, 699]
    assert admission.appointments.open_by_reason()["tenant_inflight"] == 3
    admission.release(grants[0], executed=True, now=0.399)
    newcomer = admission.decide(0.399, Ask(tenant=tenant, max_new_tokens=4))
    assert not isinstance(newcomer, Grant) and newcomer.reason == "tenant_inflight"  # kept for the holder
    back = Ask(tenant=tenant, max_new_tokens=4)
    back.appointment = booked[0]  # (as `find` recognises it by its ticket)
    holder = admission.decide(0.399, back)
    assert isinstance(holder, Grant)
    assert admission.appointments.outcomes[("tenant_inflight", "on_time")] == 1


def test_a_tenants_token_cap_books_the_release_of_enough_of_its_own_cost_and_keeps_it() -> None:
    """tenant_tokens: a frame lacking cost under its tenant's max_inflight_tokens is told when
    enough of that tenant's own requests' cost comes back (another tenant's requests free none of
    it), and that cost is kept for it: a newcomer of the tenant is refused while the window is open."""
    state = make_state(
        max_inflight=32,
        hint_policy=RetryHintPolicy(jitter=0.0),
        tenants={"a": TenantLimits(max_inflight_tokens=100), "b": TenantLimits()},
        tenant_from_frame=True,
    )
    admission = state.admission
    a, b = admission.tenants.resolve("a"), admission.tenants.resolve("b")
    grants = {}
    for name, tenant, tokens in (("b", b, 2), ("a", a, 4)):  # b's ends at 0.2 s, a's at 0.4 s (prior step)
        grant = admission.decide(0.0, Ask(tenant=tenant, max_new_tokens=tokens, cost=60))
        assert isinstance(grant, Grant)
        grants[name] = grant
    refused = admission.decide(0.1, Ask(tenant=a, max_new_tokens=4, cost=60))
    assert not isinstance(refused, Grant) and refused.reason == "tenant_tokens"
    booked = refused.appointment  # (a refusal is read at once: the limit's next one reuses it)
    assert booked is not None and refused.hint_ms == 299  # a's own end, be here by
    admission.release(grants["a"], executed=True, now=0.4)
    newcomer = admission.decide(0.4, Ask(tenant=a, max_new_tokens=4, cost=60))
    assert not isinstance(newcomer, Grant) and newcomer.reason == "tenant_tokens"  # kept for the holder
    back = Ask(tenant=a, max_new_tokens=4, cost=60)
    back.appointment = booked
    assert isinstance(admission.decide(0.4, back), Grant)
    assert admission.appointments.outcomes[("tenant_tokens", "on_time")] == 1


def test_a_guaranteed_tenant_is_admitted_past_the_full_cap_up_to_its_allowance() -> None:
    # Fixed hints: no appointment keeps a slot for the refused frames, the allowance alone acts.
    state = make_state(
        max_inflight=4,
        tenants={"a": TenantLimits(), "b": TenantLimits(guaranteed_inflight=2)},
        tenant_from_frame=True,
        hint_policy=RetryHintPolicy(adaptive=False),
    )
    ingress, writes = make_ingress(state)
    admission = state.admission
    ingress.receive_data(b"".join(frame(f"a{i}", tenant="a") for i in range(5)))
    assert admission.inflight.inflight == 4 and [r["reason"] for r in replies(writes)] == ["inflight"]
    ingress.receive_data(b"".join(frame(f"b{i}", tenant="b") for i in range(3)))
    assert admission.inflight.inflight == 6  # b's two, past the cap; its third waits like anyone
    assert {r["id"]: r["reason"] for r in replies(writes)} == {"a4": "inflight", "b2": "inflight"}
    tenant_b = admission.tenants.resolve("b")
    assert tenant_b.inflight == 2
    # Back under the cap only once in-flight is: a's next frames wait while b's two run.
    a_requests = [r for r in ingress.active.values() if r.client_id.startswith("a")]
    finish(state, a_requests[0])
    ingress.receive_data(frame("a5", tenant="a"))
    assert "a5" not in ingress.active and admission.inflight.inflight == 5
    for request in [r for r in ingress.active.values() if r.client_id.startswith("b")]:
        finish(state, request)
    ingress.receive_data(frame("a6", tenant="a"))
    assert "a6" in ingress.active and admission.inflight.inflight == 4
    rows = {t["name"]: t for t in state.snapshot()["tenants"]}
    assert (rows["b"]["guaranteed_inflight"], rows["a"]["guaranteed_inflight"]) == (2, 0)


def test_critical_frames_are_admitted_past_the_full_cap_up_to_the_class_allowance() -> None:
    # Fixed hints: no appointment keeps a slot for the refused frames, the allowance alone acts.
    state = make_state(
        max_inflight=4, ceilings=CeilingPolicy(critical_allowance=2), hint_policy=RetryHintPolicy(adaptive=False)
    )
    ingress, writes = make_ingress(state)
    admission = state.admission
    ingress.receive_data(b"".join(frame(f"s{i}") for i in range(5)))
    assert admission.inflight.inflight == 4 and [r["id"] for r in replies(writes)] == ["s4"]
    ingress.receive_data(b"".join(frame(f"c{i}", priority="critical") for i in range(3)))
    assert admission.inflight.inflight == 6  # two critical past the cap; the third is refused like anyone
    assert {r["id"]: r["reason"] for r in replies(writes)} == {"s4": "inflight", "c2": "inflight"}
    # The classes below get back in only under the cap: a release frees no slot for them while
    # in-flight is past it (and the critical refusal closed their gate as well).
    finish(state, next(r for r in ingress.active.values() if r.client_id == "s0"))
    ingress.receive_data(frame("s5"))
    assert "s5" not in ingress.active and admission.inflight.inflight == 5
    ingress.receive_data(frame("c3", priority="critical"))
    assert "c3" in ingress.active and admission.inflight.inflight == 6


def test_class_allowance_parses_for_critical_only() -> None:
    assert GovernorConfig(class_allowance=("critical=2",)).ceiling_policy().critical_allowance == 2
    assert GovernorConfig().ceiling_policy().critical_allowance == 0
    for text, message in (
        ("standard=2", "only critical"),
        ("critical", "expected CLASS=D"),
        ("critical=x", "not a whole number"),
        ("critical=-1", "must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            GovernorConfig(class_allowance=(text,)).ceiling_policy()


def test_guaranteed_inflight_parses_and_may_not_exceed_the_tenants_own_cap() -> None:
    assert parse_tenant("b,guaranteed_inflight=3")[1].guaranteed_inflight == 3
    with pytest.raises(ValueError, match="guaranteed_inflight cannot exceed"):
        parse_tenant("b,max_inflight=2,guaranteed_inflight=3")
    with pytest.raises(ValueError, match=">= 0"):
        parse_tenant("b,guaranteed_inflight=-1")


@pytest.mark.parametrize("loan", [0, 4])
def test_a_tenant_below_its_share_is_lent_a_slot_past_the_cap_and_the_one_over_it_pays_it_back(loan: int) -> None:
    """With `--tenant-loan` (opt-in); without it, the cap is hard for the quiet tenant too."""
    clock = FakeClock()
    # No stream seen and the fake worker streams none: one token at the endpoint's prior step of
    # 0.5 s, so each request ends 0.5 s after its admission (its first token is a step on).
    endpoint = Endpoint("fake", EndpointLimits(step_ms=500), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=4,
        clock=clock,
        endpoints=[endpoint],
        tenants={"a": TenantLimits(), "b": TenantLimits()},
        tenant_from_frame=True,
        share_threshold=0.5,
        hint_policy=RetryHintPolicy(jitter=0.0),
        timers=(timers := FakeTimers(clock)),
        tenant_loan=loan,
    )
    state.admission.hints.observe_service_time(0.5)
    ingress, writes = make_ingress(state)
    tokens = 1
    for i in range(4):  # admitted 0.1 s apart: they end 0.1 s apart (a service time of 0.5 s each)
        ingress.receive_data(frame(f"a{i}", tenant="a", max_new_tokens=tokens))
        clock.advance(0.1)
    # the cap is full, but a is at its share (nobody else contends): b is refused, contends, is lifted
    ingress.receive_data(frame("b0", tenant="b", max_new_tokens=tokens))
    assert "b0" not in ingress.active
    finish_as_reserved(state, ingress.active["a0"])
    ingress.receive_data(frame("a4", tenant="a", max_new_tokens=tokens))  # a takes the slot: now over its share
    a_tenant, b_tenant = (state.admission.tenants.resolve(n) for n in "ab")
    assert a_tenant.service > b_tenant.service
    ingress.receive_data(
        frame("a5", tenant="a", max_new_tokens=tokens) + frame("a6", tenant="a", max_new_tokens=tokens)
    )
    # b, under its share (2 of the 4 slots) while a holds all 4, is lent one past the cap at once
    ingress.receive_data(frame("b1", tenant="b", max_new_tokens=tokens))
    if not loan:
        assert "b1" not in ingress.active and state.admission.inflight.inflight == 4
        return
    assert "b1" in ingress.active
    assert state.admission.inflight.inflight == 5
    # a pays it back: a5, told the next release (a1's), finds the cap still full then and is held
    yields = {r["id"]: r for r in replies(writes) if r["status"] == "yield"}
    assert set(yields) >= {"a5", "a6"} and yields["a5"]["retry_hint_ms"] < yields["a6"]["retry_hint_ms"]
    clock.advance(yields["a5"]["retry_hint_ms"] / 1000)
    finish_as_reserved(state, ingress.active["a1"])
    ingress.receive_data(frame("a5", tenant="a", max_new_tokens=tokens, retry_ticket=yields["a5"]["retry_ticket"]))
    assert "a5" not in ingress.active and len(state.lobby) == 1
    assert state.admission.inflight.inflight == 4
    # the next release is its: a5 is admitted from the lobby, within its promise horizon
    finish_as_reserved(state, ingress.active["a2"])
    timers.fire_due()
    assert "a5" in ingress.active
