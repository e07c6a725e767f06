"""benchmarks/peers/cold_burst.py's arithmetic on made-up bursts: a burst's wall time, refusals and
retries, the ratios to the server alone, the refusal target and the figures' bars (the benchmark
itself runs the real processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.harness.results import RESULTS_ENV, Sitting
from benchmarks.peers.cold_burst import ALONE, Burst, Round, Setting, record, refusal_excess, settings_of
from benchmarks.peers.sdk_overload import Request


def req(end: float, ok: bool = True, statuses: tuple[int, ...] = (200,), error: str | None = None) -> Request:
    return Request(start=0.0, end=end, ok=ok, error=error, statuses=list(statuses))


def test_a_burst_ends_at_its_last_completion_not_at_a_later_refusal() -> None:
    b = Burst.of(
        [req(1.0), req(1.5, statuses=(429, 429, 200)), req(3.0, ok=False, statuses=(429,), error="RateLimitError")]
    )
    assert (b.wall_s, b.completed, b.refused) == (1.5, 2, 1)
    assert (b.retries, b.refusals_429, b.failures) == (2, 3, {"RateLimitError": 1})


def test_a_burst_with_nothing_completed_ends_at_its_last_refusal() -> None:
    b = Burst.of([req(0.2, ok=False, statuses=(429,), error="RateLimitError")] * 3)
    assert (b.wall_s, b.completed, b.refused, b.retries) == (0.2, 0, 3, 0)


@given(
    st.lists(
        st.tuples(
            st.floats(0.01, 100), st.booleans(), st.lists(st.sampled_from([200, 429, 500]), min_size=1, max_size=5)
        ),
        min_size=1,
    )
)
def test_a_burst_counts_every_request_once_and_its_wall_covers_its_completions(
    calls: list[tuple[float, bool, list[int]]],
) -> None:
    requests = [req(end, ok, tuple(statuses)) for end, ok, statuses in calls]
    b = Burst.of(requests)
    assert b.completed + b.refused == len(requests)
    assert b.retries == sum(len(s) - 1 for _, _, s in calls)
    assert all(b.wall_s >= r.end for r in requests if r.ok)


def burst(wall: float, refused: int = 0) -> Burst:
    return Burst(wall_s=wall, completed=48 - refused, refused=refused, retries=0, refusals_429=refused)


def test_settings_put_the_server_alone_first_then_each_tree_k_and_horizon() -> None:
    args = argparse.Namespace(concurrency=[1, 2], horizons=["default", "60000"])
    names = [s.name for s in settings_of(args, "before abc1234")]
    assert names[0] == ALONE and len(names) == 9
    assert names[1:3] == ["K=1, default horizon", "K=1, horizon 60 s"]
    assert names[5] == "before abc1234: K=1, default horizon"
    assert Setting(k=1).horizon_ms() == 1000.0 and Setting(k=1, horizon="60000").horizon_ms() == 60_000.0


def test_the_refusal_target_is_the_median_of_per_round_cold_minus_third() -> None:
    name = Setting(k=1).name
    rounds: list[Round] = [
        {name: [burst(1.0, 27), burst(1.0, 13), burst(1.0, 11)]},
        {name: [burst(1.0, 10), burst(1.0, 9), burst(1.0, 9)]},
        {name: [burst(1.0, 12), burst(1.0, 9), burst(1.0, 8)]},
    ]
    assert refusal_excess(rounds, name) == 4  # 16, 1, 4


def test_record_holds_this_checkout_to_the_issue_s_bars_and_the_baseline_to_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    args = argparse.Namespace(concurrency=[1, 2], horizons=["default", "60000"])
    settings = settings_of(args, "before abc1234")
    alone = [burst(1.3)] * 3
    slow = [burst(21.6), burst(2.75), burst(1.4)]  # overload-sitting-3 §3, at 60 s
    fast = [burst(1.44), burst(1.38), burst(1.37)]
    refusing = [burst(1.5, 27), burst(1.0, 13), burst(1.3, 11)]
    rounds: list[Round] = []
    for _ in range(3):
        r: Round = {ALONE: alone}
        for s in settings[1:]:
            r[s.name] = refusing if s.horizon == "default" else (slow if s.tree else fast)
        rounds.append(r)
    sitting = Sitting(("governor",), name="peers.cold_burst", command="python -m benchmarks.peers.cold_burst")
    record(sitting, rounds, settings, {s.name: [2, 3, 2] for s in settings}, clients=48)
    headlines = [f.name for f in sitting.figures if f.headline]
    assert headlines[0] == "cold burst, wall time as a share of the server alone's, K=1, horizon 60 s"
    figures = {f.name: f for f in sitting.figures}
    k1 = figures["cold burst, wall time as a share of the server alone's, K=1, horizon 60 s"]
    assert k1.ratio == pytest.approx(1.3 / 1.44) and (k1.bar, k1.met) == ("ratio >= 0.8", True)
    k2 = figures["cold burst, wall time as a share of the server alone's, K=2, horizon 60 s"]
    assert k2.bar == "ratio >= 0.9" and k2.met is True
    before = figures["cold burst, wall time as a share of the server alone's, before abc1234: K=1, horizon 60 s"]
    assert before.ratio == pytest.approx(1.3 / 21.6) and before.bar is None and not before.headline
    assert (
        k1.headline
        and not figures["cold burst, wall time as a share of the server alone's, K=1, default horizon"].headline
    )
    refused = figures["cold burst, requests refused for good, K=1, default horizon"]
    assert (refused.value, refused.baseline_value, refused.difference) == (27, 11, 16)
    assert (refused.bar, refused.met) == ("<= the third burst + 4.8", False)
    assert (
        figures["completions no client asked for (the governor's probes), per fresh governor, K=2, horizon 60 s"].value
        == 2
    )
    assert len(sitting.details["rounds"]) == 3 and "requests" not in sitting.details["rounds"][0][ALONE][0]
