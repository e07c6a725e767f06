"""Submit schedules: absolute targets, poisson gaps, relative pauses."""

from __future__ import annotations

import random

import pytest

from governor.bench.schedule import ScheduleKind, SubmitSchedule, submit_lags


def test_absolute_targets_t0_plus_i_times_interval() -> None:
    targets = SubmitSchedule(ScheduleKind.ABSOLUTE, 0.25).targets(4, random.Random(0))
    assert targets == [0.0, 0.25, 0.5, 0.75]
    assert submit_lags(targets, [0.0, 0.3, 0.5, 0.8]) == pytest.approx([0.0, 0.05, 0.0, 0.05])


def test_poisson_gaps_average_the_interval_over_many_draws() -> None:
    targets = SubmitSchedule(ScheduleKind.POISSON, 0.01).targets(20_000, random.Random(7))
    assert targets is not None and targets[0] == 0.0
    gaps = [b - a for a, b in zip(targets, targets[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.01, rel=0.03)
    assert len(set(gaps)) > len(gaps) // 2  # not a fixed rate


def test_relative_has_no_targets_only_a_pause_and_zero_is_a_burst() -> None:
    relative = SubmitSchedule(ScheduleKind.RELATIVE, 0.1)
    assert relative.targets(3, random.Random(0)) is None and relative.interval_s == 0.1
    assert SubmitSchedule(ScheduleKind.POISSON, 0.0).targets(3, random.Random(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        SubmitSchedule(ScheduleKind.ABSOLUTE, -1.0)
