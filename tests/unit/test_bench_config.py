"""`governor bench` options and workload prompts."""

from __future__ import annotations

import random

import pytest

from governor.bench.config import BenchConfig
from governor.bench.runner import make_prompts
from govwire.options import ConfigError


def test_prompt_length_distributions_and_unique_prompts() -> None:
    fixed = make_prompts(BenchConfig(num_requests=5, prompt_len_dist="fixed:12"), random.Random(0))
    assert [len(p) for p in fixed] == [12] * 5 and len(set(fixed)) > 1
    spread = make_prompts(BenchConfig(num_requests=200, prompt_len_dist="uniform:3-9"), random.Random(0))
    assert {len(p) for p in spread} == set(range(3, 10))
    repeated = make_prompts(BenchConfig(num_requests=3, prompt="ab", prompt_repeats=3), random.Random(0))
    assert repeated == ["ababab"] * 3
    unique = make_prompts(BenchConfig(num_requests=3, prompt="ab", unique_prompts=True), random.Random(0))
    assert unique == ["0: ab", "1: ab", "2: ab"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_len_dist": "uniform:9-3"},
        {"prompt_len_dist": "normal:5"},
        {"num_requests": 0},
        {"submit_interval_ms": -1.0},
        {"submit_work_ms": -0.5},
        {"address": "nowhere"},
        {"direct": "unix:"},
        {"concurrency": -1},
        {"tenant_mix": "A/urgent=1"},
        {"tenant_mix": "A=0,B=1"},
        {"tenant_token": ("A=/nonexistent/token",)},
    ],
)
def test_invalid_options_are_refused_naming_the_flag(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="--"):
        BenchConfig(**kwargs)  # type: ignore[arg-type]
