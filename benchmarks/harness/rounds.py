"""Alternating rounds: how every side-by-side comparison here is run.

A shared machine drifts over a sitting (a neighbour's job, clocks, caches). Measuring one side for
a while and then the other puts that drift into the comparison. So each round runs every side
once, in an order that alternates between rounds (reversed every other round, or rotated when
each of several sides should lead in turn), and a figure is the median over rounds; a ratio is the
median of the per-round ratios, which cancels whatever moved both sides of one round together.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def order(round_: int, sides: Sequence[T], *, rotate: bool = False) -> list[T]:
    """The sides in round `round_`'s order: as given in even rounds and reversed in odd ones, or
    (`rotate`) starting one further along each round."""
    if rotate:
        k = round_ % len(sides)
        return [*sides[k:], *sides[:k]]
    return list(sides) if round_ % 2 == 0 else list(sides)[::-1]


def alternate(rounds: int, sides: Mapping[str, Callable[[], R]], *, rotate: bool = False) -> list[dict[str, R]]:
    """Run every side once per round, in `order`; one {side: result} per round."""
    results = []
    for r in range(rounds):
        results.append({name: sides[name]() for name in order(r, list(sides), rotate=rotate)})
    return results


def median(rounds: Sequence[Mapping[str, R]], side: str, pick: Callable[[R], float | None]) -> float | None:
    """The median over rounds of one side's figure (rounds where it has none left out)."""
    values = [v for r in rounds if (v := pick(r[side])) is not None]
    return statistics.median(values) if values else None


def paired_ratio(
    rounds: Sequence[Mapping[str, R]], side: str, baseline: str, pick: Callable[[R], float | None]
) -> float | None:
    """The median over rounds of side / baseline, each round's pair divided on its own."""
    ratios = [a / b for r in rounds if (a := pick(r[side])) is not None and (b := pick(r[baseline]))]
    return statistics.median(ratios) if ratios else None
