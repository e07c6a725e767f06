"""benchmarks/peers/hint_policies.py's accounting, on made-up SDK calls: which retries came at or
after the wait their 429 named and were admitted, goodput at an SLO, retries per success, and the
governor's own count of kept promises."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.peers.hint_policies import (
    Returns,
    good,
    kept_by_governor,
    outcomes,
    policies,
    pooled,
    retries_per_success,
    returns_of,
    within,
)
from benchmarks.peers.sdk_overload import Request, Run

NAN = float("nan")


def call(
    statuses: list[int], hints_ms: list[float], sent: list[float], answered: list[float], ttft: float | None = None
) -> Request:
    """A call whose attempts were sent and answered at those times (seconds from the run's start)."""
    ok = statuses[-1] == 200
    request = Request(start=sent[0], end=answered[-1] + 0.5, ok=ok, ttft=ttft if ok else None)
    request.statuses, request.hints_ms, request.sent, request.answered = statuses, hints_ms, sent, answered
    return request


def test_a_retry_at_its_named_wait_is_on_time_and_counts_admitted_only_with_a_200() -> None:
    kept = call([429, 200], [300.0], [0.0, 0.31], [0.01, 0.5], ttft=0.6)
    broken = call([429, 429], [300.0, NAN], [1.0, 1.3105], [1.0105, 1.4])  # 0.3 s after: on time, refused
    assert returns_of([kept, broken]) == Returns(on_time=2, on_time_admitted=1)
    assert returns_of([kept, broken]).on_time_share == pytest.approx(0.5)


def test_a_retry_before_its_wait_is_early_and_one_after_no_named_wait_is_unnamed() -> None:
    early = call([429, 200], [1000.0], [0.0, 0.5], [0.01, 0.6], ttft=0.7)
    backoff = call([429, 429, 200], [NAN, NAN], [0.0, 0.4, 1.2], [0.01, 0.41, 1.3], ttft=1.4)
    back = returns_of([early, backoff])
    assert (back.early, back.on_time, back.unnamed, back.unnamed_admitted) == (1, 0, 2, 1)
    assert back.on_time_share is None and back.unnamed_share == pytest.approx(0.5)


def test_a_call_whose_attempts_do_not_line_up_is_left_out() -> None:
    no_answer = call([429, 200], [100.0], [0.0, 0.2], [0.01], ttft=0.3)  # the retry's response never timed
    first_try = call([200], [], [0.0], [0.1], ttft=0.1)
    assert returns_of([no_answer, first_try]) == Returns()


def test_within_counts_completed_calls_by_their_ttft_from_the_first_attempt() -> None:
    requests = [call([200], [], [0.0], [0.1], ttft=t) for t in (0.5, 1.5, 2.5)]
    requests.append(call([429], [NAN], [0.0], [3.5]))  # failed: never within
    run = Run("poisson", "p", requests, slo_s=2.0)
    assert (within(run, 2.0), within(run, 10.0), within(run, 0.1)) == (2, 3, 0)
    assert retries_per_success(run) == pytest.approx(0.0)
    retried = Run("poisson", "p", [call([429, 429, 200], [1.0, 1.0], [0, 1, 2], [0.5, 1.5, 2.5], ttft=3.0)], 2.0)
    assert retries_per_success(retried) == pytest.approx(2.0)
    assert retries_per_success(Run("poisson", "p", [call([429], [NAN], [0.0], [0.1])], 2.0)) is None


def test_the_governor_s_kept_share_is_admitted_over_returns_in_their_window() -> None:
    counts = {"returns": {"inflight on_time": 9, "inflight yielded_again": 1, "tokens on_time": 10, "inflight late": 5}}
    assert kept_by_governor(counts) == pytest.approx(19 / 20)
    assert kept_by_governor({}) is None
    assert outcomes([counts, counts, {}]) == {"on_time": 38, "yielded_again": 2, "late": 10}


def test_pooled_sums_a_policy_s_returns_over_rounds() -> None:
    def rnd(ok: bool) -> dict[str, Run]:
        status = 200 if ok else 429
        r = call([429, status], [100.0, NAN][: 1 + (not ok)], [0.0, 0.2], [0.01, 0.3], ttft=0.4)
        return {"ours": Run("poisson", "ours", [r], 2.0)}

    assert pooled([rnd(True), rnd(False), rnd(True)], "ours") == Returns(on_time=3, on_time_admitted=2)


def test_every_rival_runs_behind_a_plain_cap_and_ours_at_both_horizons_and_without_the_proxy() -> None:
    every = {p.name: p for p in policies(10000.0)}
    assert every["server alone"].governor_args is None and not every["server alone"].ours
    assert every["ours"].governor_args == "" and every["ours"].rule == "ours"
    assert every["ours, 10 s horizon"].governor_args == "--promise-horizon-ms 10000"
    assert every["ours, no proxy"].rule is None and every["ours, no proxy"].ours
    rivals = [p for p in every.values() if not p.ours and p.governor_args is not None]
    assert len(rivals) == 4 and all(p.governor_args == "--retry-hint fixed" and p.rule for p in rivals)


def test_a_burst_counts_requests_within_the_slo_and_poisson_divides_by_its_arrival_seconds() -> None:
    def rnd(ttfts: list[float]) -> dict[str, Run]:
        return {"ours": Run("x", "ours", [call([200], [], [0.0], [0.1], ttft=t) for t in ttfts], 2.0)}

    rounds = [rnd([0.5, 1.0, 3.0]), rnd([0.5, 3.0, 3.0]), rnd([0.1, 0.2, 0.3])]  # 2, 1, 3 within 2 s
    args = argparse.Namespace(seconds=4.0)
    assert good(rounds, "ours", 2.0, "burst cold", args) == 2
    assert good(rounds, "ours", 2.0, "poisson", args) == pytest.approx(2 / 4.0)
    assert good(rounds, "ours", 10.0, "poisson", args) == pytest.approx(3 / 4.0)
