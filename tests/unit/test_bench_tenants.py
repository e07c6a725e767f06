"""`governor bench --tenant-mix / --tenant-token`: the spec, the seeded draw, the per-group report."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.bench.config import BenchConfig
from governor.bench.report import format_run, group_summaries, run_summary, to_json, token_share
from governor.bench.runner import RunResult
from governor.bench.stats import RequestSample, summarize
from governor.bench.tenants import UNTAGGED, TenantGroup, assign_groups, parse_tenant_mix
from govwire.options import ConfigError
from govwire.vocab import Priority


def test_specs_name_tenants_classes_or_both_and_keep_their_order_and_labels() -> None:
    assert parse_tenant_mix("A=0.7,B=0.3") == (TenantGroup("A", None, 0.7), TenantGroup("B", None, 0.3))
    mixed = parse_tenant_mix("A/critical=0.2, A/sheddable=0.3 ,B=0.5")
    assert [g.label for g in mixed] == ["A/critical", "A/sheddable", "B"]
    assert mixed[0].priority is Priority.CRITICAL and [g.share for g in mixed] == pytest.approx([0.2, 0.3, 0.5])
    classes = parse_tenant_mix("/critical=1,/standard=1,/sheddable=1")
    assert [(g.tenant, g.label) for g in classes] == [("", "/critical"), ("", "/standard"), ("", "/sheddable")]
    assert [g.share for g in classes] == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("A=1,,B=1", "expected"),
        ("A", "expected"),
        ("=1", "expected"),
        ("A/urgent=1", "class"),
        ("A/=1", "class"),
        ("A=0", "share"),
        ("A=-1", "share"),
        ("A=nan", "share"),
        ("A=inf", "share"),
        ("A=lots", "share"),
        ("no spaces=1", "tenant"),
        ("A=1,A=2", "twice"),
        ("1e308=1e308,B=1e308", "too large"),
    ],
)
def test_bad_specs_are_refused_naming_the_flag_and_the_fault(spec: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=f"--tenant-mix.*{complaint}"):
        BenchConfig(tenant_mix=spec)


mixes = st.dictionaries(
    st.tuples(st.sampled_from(["", "A", "b.2", "t_3"]), st.sampled_from([None, *Priority])).filter(any),
    st.floats(1e-3, 1e3),
    min_size=1,
    max_size=6,
)


@given(mixes, st.integers(0, 2**32))
def test_shares_normalise_and_a_seed_decides_every_assignment(
    weights: dict[tuple[str, Priority | None], float], seed: int
) -> None:
    spec = ",".join(f"{t}{'' if p is None else '/' + p}={w!r}" for (t, p), w in weights.items())
    groups = parse_tenant_mix(spec)
    total = sum(weights.values())
    assert [(g.tenant, g.priority) for g in groups] == list(weights)
    assert [g.share for g in groups] == pytest.approx([w / total for w in weights.values()])
    assert sum(g.share for g in groups) == pytest.approx(1.0)
    first = assign_groups(groups, 200, random.Random(seed))
    assert first == assign_groups(groups, 200, random.Random(seed)) and set(first) <= set(groups)


@pytest.mark.parametrize("spec", ["A=0.7,B=0.3", "A/critical=0.2,A/sheddable=0.3,B=0.5", "/critical=1,/sheddable=3"])
def test_the_drawn_mix_follows_the_spec(spec: str) -> None:
    groups = parse_tenant_mix(spec)
    drawn = Counter(assign_groups(groups, 5000, random.Random(7)))
    for group in groups:
        assert drawn[group] / 5000 == pytest.approx(group.share, abs=0.02)


def test_without_a_mix_nothing_is_drawn_so_the_rest_of_the_run_is_unchanged() -> None:
    rng = random.Random(3)
    assert assign_groups((), 3, rng) == [UNTAGGED] * 3
    assert rng.random() == random.Random(3).random()
    assert BenchConfig().tenant_groups() == () and BenchConfig().tenant_tokens() == {}


def test_tenant_tokens_are_read_per_named_tenant_and_bad_entries_refused(tmp_path: Path) -> None:
    secret = tmp_path / "a.token"
    secret.write_text("a-secret\n")
    config = BenchConfig(tenant_mix="A=1,B/critical=1", tenant_token=(f"A={secret}",))
    assert config.tenant_tokens() == {"A": "a-secret"}
    for entries in ([f"C={secret}"], ["A"], [f"A={secret}", f"A={secret}"], [f"A={tmp_path / 'missing'}"]):
        with pytest.raises(ConfigError, match="--tenant-token"):
            BenchConfig(tenant_mix="A=1,B/critical=1", tenant_token=tuple(entries))
    with pytest.raises(ConfigError, match="--tenant-token"):
        BenchConfig(tenant_token=(f"A={secret}",))  # no mix names A


def sample(group: str, status: str, ttft: float = 0.01, tokens: int = 4, attempts: int = 1) -> RequestSample:
    done = status == "done"
    return RequestSample(
        0.0,
        status,
        ttft + 0.01,
        [ttft, ttft + 0.005] if done else [],
        None if done else "tenant_share" if status == "yield" else "worker_lost",
        tokens if done else 0,
        2 if done else 0,
        attempts=attempts,
        group=group,
    )


def test_each_group_is_summarised_by_the_same_function_over_its_own_samples() -> None:
    config = BenchConfig(tenant_mix="A=3,B/critical=1", slo_ttft_ms=50)
    samples = [
        sample("A", "done", ttft=0.01),
        sample("A", "done", ttft=0.2),  # misses the 50 ms TTFT SLO
        sample("A", "yield", attempts=3),
        sample("A", "error"),
        sample("B/critical", "done", ttft=0.02, tokens=10),
    ]
    result = RunResult(samples, wall_s=2.0, submit_lags_s=[], submit_wall_s=0.0, submitted=5)
    overall = run_summary(config, samples, 2.0)
    (a_group, a), (b_group, b) = group_summaries(config, result)
    assert (a_group.label, b_group.label) == ("A", "B/critical")
    assert a == summarize(samples[:4], 2.0, slo_ttft_ms=50)
    assert (a.offered, a.requests, a.yielded, sum(a.errors.values()), a.retries) == (4, 2, 1, 1, 2)
    assert (a.executed_rps, a.goodput_rps, b.executed_rps) == (1.0, 0.5, 0.5)
    assert a.offered + b.offered == overall.offered == 5
    assert token_share(a, overall) == pytest.approx(12 / 24) and token_share(b, overall) == pytest.approx(12 / 24)

    report = format_run("run 1/1", config, overall, result)
    a_line = next(line for line in report.splitlines() if line.startswith("  A "))
    assert a_line.split()[:8] == ["A", "4", "2", "1", "1", "2", "1.00", "0.50"]
    assert a_line.endswith("yields: tenant_share=1") and "goodput/s" in report
    groups = json.loads(json.dumps(to_json(config, [(overall, result)])))["runs"][0]["groups"]
    assert [(g["group"], g["tenant"], g["priority"], g["mix_share"]) for g in groups] == [
        ("A", "A", None, 0.75),
        ("B/critical", "B", "critical", 0.25),
    ]
    assert groups[1]["summary"]["requests"] == 1 and groups[1]["token_share"] == pytest.approx(0.5)
    assert groups[0]["summary"]["ttft_ms"]["p99"] == pytest.approx(198.1)


def test_a_run_without_a_mix_reports_no_groups() -> None:
    config = BenchConfig()
    result = RunResult([sample("", "done")], wall_s=1.0, submit_lags_s=[], submit_wall_s=0.0, submitted=1)
    summary = run_summary(config, result.samples, 1.0)
    assert "per --tenant-mix group" not in format_run("run", config, summary, result)
    assert to_json(config, [(summary, result)])["runs"][0]["groups"] == []
