"""Deadlines: the TTFT model, refusal on a predicted miss, and cancellation of an admitted request
whose deadline passes before its first token (simulated clock and timers)."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from governor.admission.cost import Ask
from governor.admission.limits import Grant, Refusal
from governor.admission.ttft import MIN_SAMPLES, TtftModel
from govwire.codec import encode, encode_token, generate_frame
from govwire.vocab import Op, YieldReason
from tests.fakes import FakeClock, FakeTimers, FakeUpstream, done_frame, make_ingress, make_state


def frame(rid: str, prompt: str = "hi", **fields: Any) -> bytes:
    return encode(generate_frame(rid, prompt, **fields))


def replies(writes: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in writes.lines()]


def millisecond_per_token() -> TtftModel:
    """A model with no margin that learnt an exact 1 ms per prompt token, its own or ahead of it."""
    model = TtftModel(margin=0.0)
    for own in range(0, 2000, 100):
        for ahead in (0, 500, 1000):
            model.observe(own, ahead, 0, (own + ahead) / 1000)
    return model


def test_the_model_learns_a_linear_ttft_and_adds_its_error_margin() -> None:
    model = TtftModel(margin=0.0)
    rng = random.Random(1)
    assert model.predict(32, 100, 1) is None
    for _ in range(MIN_SAMPLES - 1):
        model.observe(32, 100, 1, 0.1)
    assert model.predict(32, 100, 1) is None  # too few samples: no prediction, no refusal
    for _ in range(200):
        tokens, requests = rng.randint(0, 4000), rng.randint(0, 20)
        own = rng.choice((32, 32, 32, 896))
        # its own prompt costs twice what one ahead does per token (chunked among the others)
        model.observe(own, tokens, requests, 0.02 + own / 5_000 + tokens / 10_000 + 0.005 * requests)
    assert model.predict(32, 2000, 4) == pytest.approx(0.02 + 0.0064 + 0.2 + 0.02, rel=1e-2)
    assert model.predict(896, 2000, 4) == pytest.approx(0.02 + 0.1792 + 0.2 + 0.02, rel=1e-2)
    noisy = TtftModel(margin=2.0)
    for _ in range(300):
        tokens = rng.randint(0, 4000)
        noisy.observe(32, tokens, 0, tokens / 10_000 + rng.gauss(0, 0.01))
    fit, upper = noisy.fit(32, 1000, 0), noisy.predict(32, 1000, 0)
    assert fit is not None and upper is not None
    assert fit == pytest.approx(0.1, abs=0.01)
    assert upper - fit == pytest.approx(noisy.margin * 0.01, rel=0.3)  # the margin, in deviations of the residuals


@pytest.mark.parametrize(
    ("noise", "quantile"),
    [
        (lambda rng: rng.gauss(0, 0.01), 1.645),  # normal errors: the normal 95% quantile
        (lambda rng: rng.expovariate(100) - 0.01, 1.996),  # skewed (a long prefill ahead): ln 20 - 1
    ],
)
def test_the_margin_is_learnt_so_that_five_percent_of_first_tokens_come_later_than_predicted(
    noise: Any, quantile: float
) -> None:
    rng = random.Random(7)
    model = TtftModel(margin=0.5)  # started far too low, as a configured guess may be
    late = []
    for i in range(6000):
        tokens = rng.randint(0, 4000)
        ttft = 0.02 + tokens / 10_000 + noise(rng)
        predicted = model.predict(32, tokens, 0)
        model.observe(32, tokens, 0, ttft)
        if i >= 3000 and predicted is not None:
            late.append(ttft > predicted)
    assert sum(late) / len(late) == pytest.approx(0.05, abs=0.015)
    assert model.margin == pytest.approx(quantile, abs=0.35)


def test_coverage_counts_admitted_deadline_frames_against_their_prediction() -> None:
    clock = FakeClock()
    timers = FakeTimers(clock)
    upstream = FakeUpstream()
    state = make_state(max_inflight=16, clock=clock, upstream=upstream, timers=timers)
    endpoint = state.admission.pool.endpoints[0]
    endpoint.ttft = millisecond_per_token()  # exact: predictions are the fit
    ingress, _ = make_ingress(state)
    ingress.receive_data(frame("a", "x" * 400, deadline_ms=900) + frame("b", "x" * 400, deadline_ms=900))
    (a_uid, _), (b_uid, _) = upstream.dispatched.items()  # predicted 0.1 s and 0.2 s
    clock.advance(0.15)
    upstream.worker_sends(encode_token(a_uid, 0, 97, "a"), encode_token(b_uid, 0, 97, "a"))  # a late, b within
    ingress.receive_data(frame("c", "x" * 400, deadline_ms=900))
    clock.advance(1.0)
    assert timers.fire_due() == 1  # c expired: later than any prediction
    deadlines = state.snapshot()["deadlines"]
    assert (deadlines["met"], deadlines["expired"]) == (2, 1)
    assert (deadlines["covered"], deadlines["exceeded"], deadlines["coverage"]) == (
        1,
        2,
        pytest.approx(1 / 3, abs=1e-3),
    )
    assert set(deadlines["margin_sd"]) == {endpoint.name}


def test_a_request_predicted_to_miss_its_deadline_yields_with_the_excess_as_hint() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(max_inflight=16, clock=clock, upstream=upstream)
    endpoint = state.admission.pool.endpoints[0]
    endpoint.ttft = millisecond_per_token()
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", "x" * 1200, deadline_ms=500))  # 300 tokens: 0.3 s
    assert replies(writes) == [] and endpoint.waiting_tokens == 300
    ingress.receive_data(frame("b", "x" * 1200, deadline_ms=500))  # behind a: 0.6 s > 0.5 s
    reply = replies(writes)[-1]
    assert (reply["id"], reply["status"], reply["reason"]) == ("b", "yield", YieldReason.DEADLINE)
    assert 100 <= reply["retry_hint_ms"] <= 102  # the predicted excess: 0.1 s
    ingress.receive_data(frame("c", "x" * 1200))  # no deadline: admitted
    assert endpoint.waiting == 2 and state.accounting.yielded["deadline"] == 1


def test_a_model_that_predicts_a_miss_for_an_idle_endpoint_lets_one_probe_in_and_learns() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(max_inflight=16, clock=clock, upstream=upstream)
    endpoint = state.admission.pool.endpoints[0]
    endpoint.ttft = TtftModel(margin=0.0)
    for _ in range(MIN_SAMPLES + 2):  # it learnt 2 s first tokens (a stall): every prediction misses 1 s
        endpoint.ttft.observe(0, 0, 0, 2.0)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("probe", deadline_ms=1000) + frame("next", deadline_ms=1000))
    assert [(r["id"], r["reason"]) for r in replies(writes)] == [("next", YieldReason.DEADLINE)]
    (uid, _), *_ = upstream.dispatched.items()  # the probe, let in: nothing else ran there
    clock.advance(0.05)
    upstream.worker_sends(encode_token(uid, 0, 97, "a"))
    assert endpoint.ttft.samples == MIN_SAMPLES + 3  # its fast first token is learnt


def test_an_expired_deadline_cancels_in_the_worker_and_returns_slot_and_tokens() -> None:
    clock = FakeClock()
    timers = FakeTimers(clock)
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, clock=clock, upstream=upstream, timers=timers, max_inflight_tokens=1000)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("late", "x" * 40, deadline_ms=200) + frame("fast", "x" * 40, deadline_ms=200))
    (late_uid, _), (fast_uid, (fast, _)) = upstream.dispatched.items()
    clock.advance(0.1)
    upstream.worker_sends(encode_token(fast_uid, 0, 97, "a"))
    clock.advance(0.1)
    assert timers.fire_due() == 1  # fast's timer was cancelled at its first token
    assert replies(writes)[-1] == {
        "id": "late",
        "status": "error",
        "code": "deadline_exceeded",
        "message": "no first token within deadline_ms 200",
    }
    assert upstream.sent_frames == [{"id": late_uid, "op": Op.CANCEL}]  # the worker stops it
    assert state.admission.inflight.inflight == 1 and state.admission.tokens.held == fast.grant.ask.cost
    assert state.accounting.deadlines == {"met": 1, "expired": 1}
    assert state.accounting.failed["deadline_exceeded"] == 1
    # Both taught the endpoint's TTFT model: the expired one as a TTFT of at least its deadline.
    assert state.admission.pool.endpoints[0].ttft.samples == 2
    # The link no longer routes the worker's own final reply for it (it drops it when it comes).
    assert late_uid not in upstream.link.inflight and fast_uid in upstream.link.inflight
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_a_request_that_ends_before_its_deadline_leaves_no_timer_behind() -> None:
    clock = FakeClock()
    timers = FakeTimers(clock)
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, clock=clock, upstream=upstream, timers=timers)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", deadline_ms=50))
    (uid,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid, "", "eos"))  # a done with no token first
    clock.advance(1.0)
    assert timers.fire_due() == 0 and [r["status"] for r in replies(writes)] == ["done"]


def test_a_queue_the_deadline_cannot_clear_is_refused_before_any_first_token_is_known() -> None:
    """The cold start: a batch-1 worker (its statistics say --max-running 1) with 8 long requests
    on it, the TTFT model without a single sample. The running one streams a token every 20 ms and
    asked for 100: a frame with deadline_ms 20 is 8 ends away from starting, and is refused at
    once instead of being admitted and cut at its deadline."""
    clock = FakeClock()
    state = make_state(max_inflight=32, clock=clock)
    admission = state.admission
    (endpoint,) = admission.pool.endpoints
    endpoint.batch = 1
    grants = [admission.decide(clock(), Ask(max_new_tokens=100)) for _ in range(8)]
    assert all(isinstance(g, Grant) for g in grants)
    running = cast_stream(grants[0])
    for i in range(5):
        running.token(clock() + 0.02 * i)
    now = clock() + 0.09
    assert endpoint.ttft.predict(0, 0, 0) is None  # the model knows nothing yet
    refused = admission.decide(now, Ask(max_new_tokens=4, deadline_s=0.02))
    assert isinstance(refused, Refusal) and refused.reason == YieldReason.DEADLINE
    # its start is at least the running one's end, 95 tokens away: far past 20 ms
    assert refused.hint_ms >= 95 * 20 - 20
    # a frame without a deadline is admitted as before
    assert isinstance(admission.decide(now, Ask(max_new_tokens=4)), Grant)


class _Stream:
    def __init__(self) -> None:
        self.tokens_seen = 0
        self.t_first_token: float | None = None
        self.t_last_token = 0.0

    def token(self, now: float) -> None:
        self.tokens_seen += 1
        self.t_last_token = now
        if self.t_first_token is None:
            self.t_first_token = now


def cast_stream(grant: Any) -> _Stream:
    stream = _Stream()
    grant.progress = stream
    return stream
