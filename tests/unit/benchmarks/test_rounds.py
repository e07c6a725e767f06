"""benchmarks/harness/rounds.py: the order of alternating rounds, and medians over them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from benchmarks.harness.rounds import alternate, median, order, paired_ratio


def test_two_sides_swap_every_round_and_several_rotate() -> None:
    assert [order(r, ["bare", "governor"]) for r in range(3)] == [
        ["bare", "governor"], ["governor", "bare"], ["bare", "governor"],
    ]  # fmt: skip
    assert [order(r, "abc", rotate=True) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"],
    ]  # fmt: skip


@given(st.lists(st.integers(), min_size=1, max_size=6, unique=True), st.integers(0, 50), st.booleans())
def test_every_round_runs_every_side_once(sides: list[int], round_: int, rotate: bool) -> None:
    assert sorted(order(round_, sides, rotate=rotate)) == sorted(sides)


def test_alternate_runs_each_side_once_per_round_in_that_order() -> None:
    calls: list[str] = []

    def side(name: str) -> object:
        return lambda: calls.append(name) or len(calls)

    rounds = alternate(3, {"a": side("a"), "b": side("b")})
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert rounds == [{"a": 1, "b": 2}, {"b": 3, "a": 4}, {"a": 5, "b": 6}]


def test_medians_and_paired_ratios_over_rounds() -> None:
    rounds = [
        {"gov": 8.0, "bare": 10.0},
        {"gov": 4.0, "bare": 10.0},
        {"gov": 9.0, "bare": 9.0},
        {"gov": None, "bare": 1},
    ]
    assert median(rounds, "gov", lambda v: v) == 8.0  # the round without a value left out
    # Per round 0.8, 0.4, 1.0: the median of the ratios, not the ratio of the medians (8 / 9.5).
    assert paired_ratio(rounds, "gov", "bare", lambda v: v) == 0.8
    assert median([], "gov", lambda v: v) is None and paired_ratio([], "gov", "bare", lambda v: v) is None
