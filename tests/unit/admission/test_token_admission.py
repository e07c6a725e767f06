"""Token-cost admission through the ingress on a simulated clock: budgets never exceeded, refusals
leave no trace, reservations settled with the real counts, too-large requests refused for good."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.admission.cost import CostModel
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintPolicy
from governor.doors.ndjson import Ingress
from governor.doors.openai_api import cost_view
from governor.lifecycle import InflightRequest
from governor.state import ServerState
from govwire.codec import encode, encode_token, generate_frame
from govwire.vocab import YieldReason
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


def token(state: ServerState, request: InflightRequest) -> None:
    """The worker's next token frame for `request`, read by its link."""
    worker_sends(state, encode_token(request.uid, 0, 97, "a"))


def test_the_cost_is_the_declared_or_estimated_prompt_plus_the_weighted_output() -> None:
    costs = CostModel(bytes_per_token=4.0, output_weight=0.5, max_new_tokens_limit=100)
    ask = costs.ask({"id": "a", "prompt": "x" * 41, "max_new_tokens": 10, "deadline_ms": 250})
    assert (ask.prompt_tokens, ask.declared, ask.cost, ask.deadline_s) == (11, False, 16, 0.25)
    ask = costs.ask({"id": "a", "prompt": "é" * 4, "prompt_tokens": 3})  # declared: 3; 8 UTF-8 bytes
    assert (ask.prompt_bytes, ask.prompt_tokens, ask.declared, ask.max_new_tokens, ask.cost) == (8, 3, True, 16, 11)
    # Fields of the wrong type count as absent here; validation after admission rejects them.
    ask = costs.ask({"id": "a", "prompt": 7, "max_new_tokens": "9", "prompt_tokens": -1, "deadline_ms": True})
    assert (ask.prompt_tokens, ask.max_new_tokens, ask.deadline_s) == (0, 16, None)


def test_the_bytes_per_token_ratio_is_calibrated_from_the_real_counts() -> None:
    costs = CostModel(bytes_per_token=4.0, output_weight=1.0, max_new_tokens_limit=100)
    for _ in range(50):
        ask = costs.ask({"prompt": "y" * 300})
        assert costs.settle(ask, prompt_tokens=100, completion_tokens=5) == 105
    assert costs.bytes_per_token == pytest.approx(3.0)
    assert costs.ask({"prompt": "y" * 300}).prompt_tokens == 100
    assert costs.accuracy["estimated"].count == 50 and costs.accuracy["declared"].count == 0


def test_a_frame_runs_to_its_length_only_when_it_says_so() -> None:
    """`stop_on_eos: false` (the front door's `ignore_eos: true`): its length is known, the release
    forecast reads all of `max_new_tokens`; any other frame may end at an end of sequence."""
    costs = CostModel(bytes_per_token=4.0, output_weight=1.0, max_new_tokens_limit=100)
    assert costs.ask({"prompt": "x", "stop_on_eos": False}).to_length
    assert not costs.ask({"prompt": "x"}).to_length and not costs.ask({"prompt": "x", "stop_on_eos": True}).to_length
    assert not costs.ask({"prompt": "x", "stop_on_eos": 0}).to_length  # not a boolean: the default
    body = {"model": "m", "prompt": "x", "max_tokens": 4}
    assert costs.ask(cost_view({**body, "ignore_eos": True})).to_length
    assert (
        not costs.ask(cost_view(body)).to_length and not costs.ask(cost_view({**body, "ignore_eos": "yes"})).to_length
    )


def test_a_request_larger_than_a_whole_budget_gets_an_error_not_a_yield() -> None:
    state = make_state(max_inflight=4, max_new_tokens=512, max_inflight_tokens=100)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("big", "x" * 40, max_new_tokens=95))  # 10 + 95 > 100
    (reply,) = replies(writes)
    assert (reply["status"], reply["code"], reply["id"]) == ("error", "over_budget", "big")
    assert "--max-inflight-tokens of 100" in reply["message"]
    assert state.admission.tokens.held == 0 and state.accounting.rejected["over_budget"] == 1
    state = make_state(max_inflight=4, max_new_tokens=512, tokens_per_s=10.0, tokens_burst=50.0)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("big", "x" * 40, max_new_tokens=41))
    assert replies(writes)[-1]["code"] == "over_budget"


def test_an_early_eos_returns_its_unused_tokens_at_once() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=8, upstream=upstream, max_inflight_tokens=100, tokens_per_s=1.0, tokens_burst=100)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", "x" * 40, max_new_tokens=50))  # reserves 10 + 50
    ingress.receive_data(frame("b", "x" * 40, max_new_tokens=50))
    assert replies(writes)[-1]["reason"] == YieldReason.TOKENS  # 60 held + 60 > 100
    ((uid, (request, _)),) = upstream.dispatched.items()
    assert state.admission.tokens.held == 60
    assert state.admission.token_rate.bucket is not None
    assert state.admission.token_rate.bucket.level(state.clock()) == pytest.approx(40)
    upstream.worker_sends(done_frame(uid, "ab", "eos", prompt_tokens=12, completion_tokens=2))
    # Settled at 12 + 2: the in-flight budget is free and the rate bucket gets back 60 - 14.
    assert state.admission.tokens.held == 0
    assert state.admission.token_rate.bucket.level(state.clock()) == pytest.approx(86)
    assert (state.accounting.tokens_reserved, state.accounting.tokens_settled) == (60, 14)
    ingress.receive_data(frame("c", "x" * 40, max_new_tokens=50))
    assert replies(writes)[-1]["status"] == "done" and len(upstream.dispatched) == 2


def test_token_yields_hint_when_the_budget_will_have_drained_or_refilled() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(
        max_inflight=8,
        max_new_tokens=512,
        clock=clock,
        upstream=upstream,
        hint_policy=RetryHintPolicy(jitter=0.0),
        tokens_per_s=100.0,
        tokens_burst=100.0,
    )
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", "x" * 40, max_new_tokens=70))  # 80 of the 100 banked
    ingress.receive_data(frame("b", "x" * 40, max_new_tokens=30) + frame("c", "x" * 40, max_new_tokens=30))
    # 20 left: b needs 40, there in 0.2 s; c is booked after b, 0.4 s later.
    assert [(r["reason"], r["retry_hint_ms"]) for r in replies(writes)] == [("token_rate", 200), ("token_rate", 600)]
    clock.advance(0.2)
    ingress.receive_data(frame("b", "x" * 40, max_new_tokens=30))
    assert len(upstream.dispatched) == 2
    # No stream seen yet: a step is the endpoint's prior, 10 ms (step_ms=10).
    endpoint = Endpoint("fake", EndpointLimits(step_ms=10), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=8,
        max_new_tokens=512,
        clock=clock,
        upstream=FakeUpstream(),
        hint_policy=RetryHintPolicy(jitter=0.0),
        endpoints=[endpoint],
        max_inflight_tokens=100,
    )
    state.admission.hints.observe_service_time(2.0)  # observed, but no request's own end is read from it
    ingress, writes = make_ingress(state)
    ingress.receive_data(
        frame("a", "x" * 40, max_new_tokens=70, stop_on_eos=False) + frame("b", "x" * 40, max_new_tokens=30)
    )
    # a holds its 80 until it ends, its 70 tokens a step (10 ms) apart from its first, a step after
    # its admission: 70 x 10 ms = 0.7 s on. b's deficit of 20 is free then, not sooner
    # (release_forecast.py), and b is booked for it (appointments.py), told to be there 1 ms early
    # (the lobby holds it until a's tokens are back).
    (reply,) = replies(writes)
    assert (reply["reason"], reply["retry_hint_ms"]) == ("tokens", 699)
    assert reply["retry_ticket"]


def test_an_endpoint_budget_routes_around_and_then_yields_with_its_reason() -> None:
    clock = FakeClock()
    small = Endpoint("small", EndpointLimits(tokens=50), clock())
    big = Endpoint("big", EndpointLimits(tokens=200), clock())
    small.up = big.up = True
    state = make_state(max_inflight=8, max_new_tokens=512, clock=clock, endpoints=[small, big])
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", "x" * 40, max_new_tokens=90))  # 100: only "big" can take it
    assert (small.tokens, big.tokens) == (0, 100)
    ingress.receive_data(frame("b", "x" * 40, max_new_tokens=30) + frame("c", "x" * 40, max_new_tokens=90))
    assert (small.tokens, big.tokens) == (40, 200)
    ingress.receive_data(frame("d", "x" * 40, max_new_tokens=30))
    assert replies(writes)[-1]["reason"] == YieldReason.ENDPOINT_TOKENS
    ingress.receive_data(frame("e", "x" * 40, max_new_tokens=300))  # fits no endpoint at all
    assert replies(writes)[-1]["code"] == "over_budget"


def test_an_endpoint_budget_books_the_release_of_its_own_requests_cost_and_keeps_it() -> None:
    """endpoint_tokens: told when enough of that endpoint's own requests' cost comes back, the
    cost kept for the client: a newcomer meets the budget still full while the holder gets in."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    endpoint = Endpoint("e", EndpointLimits(tokens=100, step_ms=10), clock())
    endpoint.up = True
    state = make_state(
        max_inflight=8,
        max_new_tokens=512,
        clock=clock,
        timers=timers,
        upstream=FakeUpstream(),
        hint_policy=RetryHintPolicy(jitter=0.0),
        endpoints=[endpoint],
    )
    ingress, writes = make_ingress(state)
    ingress.receive_data(
        frame("a", "x" * 40, max_new_tokens=50, stop_on_eos=False) + frame("b", "x" * 40, max_new_tokens=40)
    )
    # a holds 60 (10 of prompt, 50 out) until its 50 tokens are out, 10 ms apart from a step after
    # its admission: 0.5 s on; b needs 50 of the 40 left
    (reply,) = replies(writes)
    assert (reply["reason"], reply["retry_hint_ms"]) == ("endpoint_tokens", 499) and reply["retry_ticket"]
    clock.advance(0.5)
    worker_sends(state, done_frame(ingress.active["a"].uid, "", "length", prompt_tokens=10, completion_tokens=50))
    ingress.receive_data(frame("c", "x" * 40, max_new_tokens=60))  # a newcomer of 70: b's 50 are kept
    assert [r["status"] for r in replies(writes)][-2:] == ["done", "yield"] and "c" not in ingress.active
    ingress.receive_data(frame("b", "x" * 40, max_new_tokens=40, retry_ticket=reply["retry_ticket"]))
    assert "b" in ingress.active and endpoint.tokens == 50
    assert state.admission.appointments.outcomes[("endpoint_tokens", "on_time")] == 1


class TokenMachine(RuleBasedStateMachine):
    """Frames of random cost (estimated or declared), completions with random real counts, worker
    losses, disconnects and time passing, over a global token budget, a token-rate bucket and two
    endpoint budgets."""

    BUDGET = 300
    ENDPOINT_BUDGETS = (150, 250)

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.upstream = FakeUpstream()
        endpoints = [
            Endpoint(f"e{i}", EndpointLimits(tokens=t), self.clock()) for i, t in enumerate(self.ENDPOINT_BUDGETS)
        ]
        for e in endpoints:
            e.up = True
        self.state = make_state(
            max_inflight=6,
            clock=self.clock,
            upstream=self.upstream,
            endpoints=endpoints,
            timers=FakeTimers(self.clock),
            max_inflight_tokens=self.BUDGET,
            tokens_per_s=200.0,
            tokens_burst=240.0,
        )
        self.conns: list[Ingress] = [make_ingress(self.state)[0] for _ in range(2)]
        self.n = 0
        self.true_cost = 0  # what the settled requests really cost, by the worker's counts

    def live(self) -> list[InflightRequest]:
        return [r for c in self.conns for r in c.active.values()]

    def snapshot(self) -> tuple[Any, ...]:
        a = self.state.admission
        bucket = a.token_rate.bucket
        assert bucket is not None
        return (
            a.inflight.inflight,
            a.tokens.held,
            unspent(bucket, a.token_rate.book, self.clock()),
            [(e.inflight, e.tokens, e.waiting, e.waiting_tokens) for e in a.pool.endpoints],
            self.state.accounting.tokens_reserved,
        )

    @rule(
        conn=st.integers(0, 1),
        chars=st.integers(0, 600),
        max_new=st.integers(1, 64),
        declared=st.none() | st.integers(0, 200),
    )
    def send(self, conn: int, chars: int, max_new: int, declared: int | None) -> None:
        self.n += 1
        fields: dict[str, Any] = {"max_new_tokens": max_new}
        if declared is not None:
            fields["prompt_tokens"] = declared
        self.state.admission.appointments.tidy(self.clock())  # (lapses give back before, not during, the frame)
        before = self.snapshot()
        yielded_before = dict(self.state.accounting.yielded)
        rejected_before = self.state.accounting.rejected_total
        self.conns[conn].receive_data(frame(f"r{self.n}", "p" * chars, **fields))
        if self.state.accounting.yielded != yielded_before or self.state.accounting.rejected_total != rejected_before:
            assert self.snapshot() == before  # a refusal leaves no trace (but tokens paid into a rate book)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def worker_streams_a_token(self, data: st.DataObject) -> None:
        token(self.state, data.draw(st.sampled_from(self.live())))

    @precondition(lambda self: self.live())
    @rule(data=st.data(), prompt_tokens=st.integers(0, 300), completion=st.integers(0, 64))
    def worker_finishes_one(self, data: st.DataObject, prompt_tokens: int, completion: int) -> None:
        request = data.draw(st.sampled_from(self.live()))
        completion = min(completion, request.grant.ask.max_new_tokens)
        self.true_cost += prompt_tokens + completion
        worker_sends(
            self.state, done_frame(request.uid, "", "eos", prompt_tokens=prompt_tokens, completion_tokens=completion)
        )

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def worker_lost(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.live()))
        rerouted = self.state.accounting.rerouted
        self.state.lifecycle.lose(request, "gone")
        if self.state.accounting.rerouted == rerouted:  # it failed: no counts, so its estimate and what it streamed
            self.true_cost += request.grant.ask.prompt_tokens + request.tokens_seen

    @rule(conn=st.integers(0, 1))
    def disconnect(self, conn: int) -> None:
        self.true_cost += sum(r.grant.ask.prompt_tokens + r.tokens_seen for r in self.conns[conn].active.values())
        self.conns[conn].connection_lost()
        self.conns[conn] = make_ingress(self.state)[0]

    @rule(seconds=st.floats(0, 2))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def no_budget_is_exceeded_and_the_held_tokens_are_the_live_reservations(self) -> None:
        a = self.state.admission
        live = self.live()
        assert a.tokens.held == sum(r.grant.ask.cost for r in live) <= self.BUDGET
        for e, budget in zip(a.pool.endpoints, self.ENDPOINT_BUDGETS, strict=True):
            mine = [r for r in live if r.grant.endpoint is e]
            assert e.tokens == sum(r.grant.ask.cost for r in mine) <= budget
            waiting = [r for r in mine if not r.grant.started]
            assert (e.waiting, e.waiting_tokens) == (len(waiting), sum(r.grant.ask.prompt_tokens for r in waiting))

    @invariant()
    def counters_balance_and_settle_to_the_truth(self) -> None:
        acc = self.state.accounting
        live = self.live()
        assert acc.unbalanced_by(self.state.admission.inflight.inflight) == 0
        assert acc.tokens_settled == self.true_cost
        assert acc.tokens_reserved == sum(r.grant.ask.cost for r in live) + sum(g for g in self._settled_reservations())

    def _settled_reservations(self) -> list[int]:
        live = {id(r) for r in self.live()}
        ended = {id(r): r for r, _ in self.upstream.dispatched.values() if id(r) not in live}  # once if re-routed
        return [r.grant.ask.cost for r in ended.values()]

    def teardown(self) -> None:
        for conn in self.conns:
            conn.connection_lost()
        a = self.state.admission
        assert a.tokens.held == 0 and all(e.tokens == 0 and e.waiting == 0 for e in a.pool.endpoints)
        assert a.token_rate.bucket is not None
        # Every reservation was settled: the bucket holds exactly what real costs left it.
        self.clock.advance(10.0)
        assert a.token_rate.bucket.level(self.clock()) == pytest.approx(240.0)


TestTokenMachine = TokenMachine.TestCase
TestTokenMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_the_bucket_is_debited_the_truth_when_a_declared_count_was_too_low() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, upstream=upstream, tokens_per_s=1.0, tokens_burst=100.0)
    ingress, _ = make_ingress(state)
    ingress.receive_data(frame("a", "x" * 400, max_new_tokens=10, prompt_tokens=5))  # a claim of 5
    (uid,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid, "", "eos", prompt_tokens=100, completion_tokens=10))
    bucket = state.admission.token_rate.bucket
    assert bucket is not None and bucket.level(state.clock()) == pytest.approx(-10.0)  # 100 - 110: a debt
    assert math.isclose(state.costs.accuracy["declared"].total, 0.05)
