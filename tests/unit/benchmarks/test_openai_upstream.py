"""benchmarks/peers/openai_upstream.py's bookkeeping: a fresh-governor run is a result file of its
own, and the share of returns admitted on time counts every kind of return (the benchmark itself
runs the real processes)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.peers.openai_upstream import Governors, variant


def args(**kwargs: object) -> argparse.Namespace:
    fields: dict[str, object] = {"governor_args": "", "global_cap": False, "client": "raw", "fresh_governor": False}
    return argparse.Namespace(**(fields | kwargs))


def test_a_fresh_governor_run_is_a_part_of_its_own() -> None:
    assert variant(args()) is None
    assert variant(args(fresh_governor=True)) == "fresh-governor"
    fresh = args(governor_args="--promise-horizon-ms 30000", fresh_governor=True)
    assert variant(fresh) == "promise-horizon-ms-30000-fresh-governor"


def test_returns_on_time_are_a_share_of_every_return_over_all_the_governors_of_a_name() -> None:
    governors = Governors(server=None, args=args())  # type: ignore[arg-type]
    governors.returns = {"governor K=1": {"on_time": 30, "late": 5, "early": 3, "yielded_again": 2}, "governor K=2": {}}
    assert governors.on_time() == {"governor K=1": pytest.approx(0.75), "governor K=2": None}
