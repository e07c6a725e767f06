"""benchmarks/admission/tenants.py's arithmetic: the Erlang ceiling, B's concurrency, pooling and the
onset / steady-state split (on made-up outcomes; the experiment itself runs the real processes)."""

from __future__ import annotations

import pytest

from benchmarks.admission.tenants import ONSET_S, b_figures, concurrency_p99, erlang_b, pool
from benchmarks.harness.experiment import Arrival, Outcome, Run


def test_erlang_b_matches_the_review_s_figures_and_falls_with_more_slots() -> None:
    assert erlang_b(8, 4.0) == pytest.approx(0.0304, abs=2e-4)  # overload-review-2 §1.2
    assert erlang_b(10, 4.0) == pytest.approx(0.0053, abs=2e-4)
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(12, 4.0) < erlang_b(10, 4.0) < erlang_b(8, 4.0)


def b(sent: float, ttft: float | None, admitted: float | None = None, ended: float | None = None) -> Outcome:
    status = "done" if ttft is not None else "yield"
    return Outcome(Arrival(sent, "p", tenant="B"), status, None, 1, ttft, sent, (), admitted, ended)


def test_concurrency_counts_the_admitted_and_unfinished_as_each_arrives() -> None:
    # three overlapping requests, then one alone
    outcomes = [b(0.0, 0.1, 0.0, 1.0), b(0.1, 0.1, 0.1, 1.0), b(0.2, 0.1, 0.2, 1.0), b(5.0, 0.1, 5.0, 5.5)]
    assert concurrency_p99(outcomes) == 3
    assert concurrency_p99([b(0.0, 0.1, 0.0, 1.0)]) == 1


def test_b_s_onset_and_steady_state_are_split_at_the_onset_and_a_late_joiner_has_no_onset() -> None:
    early = [b(0.1 * i, 1.0) for i in range(5)]  # inside the onset: slow
    steady = [b(ONSET_S + 0.1 * i, 0.05) for i in range(200)]
    run = Run("r", early + steady, wall_s=10.0)
    row = b_figures(run, solo_p99=50.0, offset=0.0)
    assert (row["b_onset_n"], row["b_onset_ttft_max_ms"]) == (5, pytest.approx(1000.0))
    assert row["b_steady_ttft_p99_ms"] == pytest.approx(50.0) and row["b_steady_vs_solo"] == pytest.approx(1.0)
    assert row["b_ttft_n"] == 205 and row["b_ttft_p99_ms"] is not None and row["b_ttft_p99_ms"] > 50.0
    late = b_figures(run, solo_p99=50.0, offset=3.0)
    assert late["b_onset_n"] == 0 and late["b_steady_n"] == 205  # every arrival counts in a late joiner's run


def test_pool_joins_every_round_s_outcomes_and_walls() -> None:
    rounds = [{"x": Run("x", [b(0.0, 0.1)], 2.0)}, {"x": Run("x", [b(0.0, 0.2), b(1.0, None)], 3.0)}]
    pooled = pool(rounds, "x")
    assert (len(pooled.outcomes), pooled.wall_s) == (3, 5.0)
