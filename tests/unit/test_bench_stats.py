"""The benchmark's statistics from synthetic timestamps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.bench.stats import Distribution, RequestSample, percentile, summarize


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100), st.floats(0, 100))
def test_percentiles_are_monotonic_and_within_range(values: list[float], q1: float, q2: float) -> None:
    low, high = sorted((q1, q2))
    p_low, p_high = percentile(values, low), percentile(values, high)
    assert p_low is not None and p_high is not None
    eps = 1e-6  # interpolation rounds; values are at most 1e6 in magnitude
    assert min(values) - eps <= p_low <= p_high + eps and p_high <= max(values) + eps


def done(t_submit: float, tokens: list[float], t_final: float, n_prompt: int = 10) -> RequestSample:
    return RequestSample(t_submit, "done", t_final, tokens, None, n_prompt, len(tokens))


def test_ttft_tpot_itl_and_latency_from_timestamps() -> None:
    s = done(1.0, [1.1, 1.3, 1.6], 1.7)
    assert s.ttft == pytest.approx(0.1)
    assert s.tpot == pytest.approx(0.25)  # (1.6 - 1.1) / 2
    assert s.itls == pytest.approx([0.2, 0.3])
    assert s.latency == pytest.approx(0.7)
    one = done(0.0, [0.5], 0.6)
    assert one.ttft == 0.5 and one.tpot is None and one.itls == []


def test_yielded_and_failed_requests_are_excluded_from_token_and_latency_figures() -> None:
    samples = [
        done(0.0, [0.1, 0.2], 0.3, n_prompt=5),
        done(0.0, [0.4, 0.5, 0.6], 0.7, n_prompt=7),
        RequestSample(0.0, "yield", 0.001, [], "inflight", attempts=1, yield_latencies=[0.001]),
        RequestSample(0.0, "error", 0.2, [0.05], "worker_lost", 9, 1),
    ]
    samples[0].ack_latency = 0.002
    summary = summarize(samples, wall_s=2.0)
    assert summary.ack_ms == Distribution.of([2.0])
    assert (summary.requests, summary.yielded, summary.errors) == (2, 1, {"worker_lost": 1})
    assert (summary.prompt_tokens, summary.completion_tokens) == (12, 5)
    assert summary.ttft_ms.count == 2 and summary.ttft_ms.p50 == pytest.approx(250)
    assert summary.itl_ms.count == 3  # 1 gap + 2 gaps, pooled
    assert summary.yield_latency_ms == Distribution.of([1.0])
    assert summary.output_tok_s == 2.5 and summary.total_tok_s == 8.5


def test_retries_count_every_attempt_after_the_first() -> None:
    retried = done(0.0, [0.5], 0.6)
    retried.attempts, retried.yield_latencies = 3, [0.001, 0.002]
    first_time = done(0.0, [0.1], 0.2)
    first_time.attempts = 1
    summary = summarize([retried, first_time], 1.0)
    assert summary.retries == 2 and summary.retry_amplification == 2.0
    assert summary.yield_latency_ms.count == 2 and summary.yielded == 0


def test_goodput_counts_done_requests_meeting_both_slos_per_second() -> None:
    samples = [
        done(0.0, [0.05, 0.06], 0.1),  # ttft 50 ms, tpot 10 ms
        done(0.0, [0.5, 0.51], 0.6),  # ttft 500 ms: misses a 100 ms TTFT SLO
        done(0.0, [0.05, 0.25], 0.3),  # tpot 200 ms: misses a 50 ms TPOT SLO
        RequestSample(0.0, "yield", 0.001, [], "inflight"),
    ]
    assert summarize(samples, 1.0).goodput_rps == 3
    assert summarize(samples, 2.0, slo_ttft_ms=100).goodput_rps == 1.0
    assert summarize(samples, 1.0, slo_ttft_ms=100, slo_tpot_ms=50).goodput_rps == 1


def test_deadline_outcomes_count_met_missed_and_refused_requests() -> None:
    samples = [
        done(0.0, [0.05, 0.06], 0.1),  # first token at 50 ms: met
        done(0.0, [0.25, 0.3], 0.4),  # at 250 ms: admitted, late
        RequestSample(0.0, "error", 0.2, [], "deadline_exceeded"),  # cancelled at its deadline
        RequestSample(0.0, "yield", 0.001, [], "deadline", attempts=1, yield_latencies=[0.001]),
        RequestSample(0.0, "yield", 0.001, [], "tokens", attempts=1, yield_latencies=[0.001]),
    ]
    summary = summarize(samples, wall_s=1.0, deadline_ms=200)
    assert summary.deadlines is not None
    assert (summary.deadlines.met, summary.deadlines.missed, summary.deadlines.refused) == (1, 2, 1)
    assert summary.deadlines.met_share == pytest.approx(1 / 3)
    assert summary.yielded_by_reason == {"deadline": 1, "tokens": 1}
    assert summarize(samples, wall_s=1.0).deadlines is None


def test_a_request_cut_off_by_a_drain_is_an_error_not_a_completion() -> None:
    import asyncio
    import random

    from governor.bench.config import BenchConfig
    from governor.bench.runner import BenchRun, _Request
    from governor.bench.tenants import TenantGroup
    from governor.client.session import Result

    run = BenchRun(BenchConfig(), [], [], random.Random(0))

    async def settle(finish_reason: str) -> RequestSample:
        request = _Request(0, "p", TenantGroup("", None, 1.0), None, RequestSample(0.0))  # type: ignore[arg-type]
        done = {"status": "done", "finish_reason": finish_reason, "prompt_tokens": 1, "completion_tokens": 2}
        run._on_event(request, 0.0, Result.from_reply(done), 1.0)
        return request.sample

    cut = asyncio.run(settle("cancelled"))
    assert (cut.status, cut.code) == ("error", "cancelled")
    assert asyncio.run(settle("length")).status == "done"
