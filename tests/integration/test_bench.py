"""`governor bench` against a real governor and echo worker: its counts match the governor's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Governor, Worker

pytestmark = pytest.mark.integration


def run_bench(gov: Governor, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "governor", "bench", "--address", f"127.0.0.1:{gov.port}", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def bench(gov: Governor, out: Path, *flags: str) -> dict[str, Any]:
    proc = run_bench(gov, "--json", str(out), *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Requests (accepted, done)" in proc.stdout
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_bench_counts_match_the_governor_stats(start_governor: Callable[..., Governor], tmp_path: Path) -> None:
    gov = start_governor("--max-inflight", "4", worker_args=("--token-delay-ms", "2"))
    plot = tmp_path / "burst.png"
    report = bench(
        gov,
        tmp_path / "burst.json",
        "--num-requests",
        "40",
        "--max-new-tokens",
        "8",
        "--no-stop-on-eos",
        "--poll-interval-ms",
        "5",
        "--plot",
        str(plot),
    )
    (run,) = report["runs"]
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert run["timeline"] and all(0 <= inflight <= 4 for _, inflight, _ in run["timeline"])
    summary = run["summary"]
    stats = gov.stats()
    assert summary["requests"] + summary["yielded"] == 40 and summary["errors"] == {}
    assert (stats["executed_total"], stats["yielded_total"]) == (summary["requests"], summary["yielded"])
    assert summary["yielded"] > 0  # a burst of 40 against a cap of 4
    assert summary["completion_tokens"] == 8 * summary["requests"]
    assert summary["ttft_ms"]["count"] == summary["requests"] and summary["itl_ms"]["count"] == 7 * summary["requests"]
    assert summary["ack_ms"]["count"] == summary["requests"]  # every admitted request was acknowledged

    retried = bench(gov, tmp_path / "retry.json", "--num-requests", "20", "--retry", "--max-retries", "50")
    summary = retried["runs"][0]["summary"]
    after = gov.stats()
    assert summary["requests"] == 20 and summary["yielded"] == 0
    assert after["executed_total"] - stats["executed_total"] == 20
    assert after["yielded_total"] - stats["yielded_total"] == summary["retries"]
    assert after["received_total"] == after["executed_total"] + after["yielded_total"]


def test_a_slow_submit_path_stretches_a_relative_schedule_but_not_an_absolute_one(
    start_governor: Callable[..., Governor], tmp_path: Path
) -> None:
    gov = start_governor("--max-inflight", "64")
    flags = ("--num-requests", "20", "--submit-interval-ms", "10", "--submit-work-ms", "5", "--max-new-tokens", "1")
    walls = {}
    for schedule in ("relative", "absolute"):
        report = bench(gov, tmp_path / f"{schedule}.json", *flags, "--submit-schedule", schedule)
        (run,) = report["runs"]
        assert run["summary"]["requests"] == 20
        submits = sorted(s["t_submit"] for s in run["samples"])
        walls[schedule] = submits[-1] - submits[0]
        if schedule == "absolute":
            assert len(run["submit_lags_s"]) == 20
    # relative: each gap is the 5 ms of submit work plus the 10 ms sleep; absolute targets 10 ms gaps
    assert walls["relative"] >= 19 * 0.015
    assert walls["absolute"] < walls["relative"]


def test_direct_mode_drives_the_worker_past_the_governor(
    start_worker: Callable[..., Worker], start_governor: Callable[..., Governor], tmp_path: Path
) -> None:
    worker = start_worker("--engine", "echo").address
    gov = start_governor("--worker", worker, "--max-inflight", "64")
    flags = ("--num-requests", "30", "--concurrency", "4", "--max-new-tokens", "3", "--no-stop-on-eos")
    through = bench(gov, tmp_path / "governor.json", *flags)["runs"][0]
    direct = bench(gov, tmp_path / "direct.json", *flags, "--direct", worker)["runs"][0]
    for run in (through, direct):
        summary = run["summary"]
        assert summary["requests"] == 30 and summary["completion_tokens"] == 90
        assert summary["ack_ms"]["count"] == 30  # the worker acknowledges too, when asked directly
    assert gov.stats()["executed_total"] == 30  # only the first run went through the governor
    assert direct["timeline"] == [] and "ttft_ms" not in direct["samples"][0]["server"]


def test_a_tenant_mix_reports_each_group_and_the_governor_counts_the_same_tenants(
    start_governor: Callable[..., Governor], tmp_path: Path
) -> None:
    gov = start_governor("--max-inflight", "64", "--tenant-from", "frame", "--tenant", "A", "--tenant", "B")
    out = tmp_path / "mix.json"
    flags = ("--num-requests", "40", "--tenant-mix", "A=1,B/critical=1", "--connections", "2", "--max-new-tokens", "4")
    proc = run_bench(gov, *flags, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per --tenant-mix group" in proc.stdout
    assert any(line.startswith("  B/critical ") for line in proc.stdout.splitlines())
    (run,) = json.loads(out.read_text())["runs"]
    groups = {g["group"]: g for g in run["groups"]}
    assert list(groups) == ["A", "B/critical"] and groups["B/critical"]["priority"] == "critical"
    offered = {name: g["summary"]["offered"] for name, g in groups.items()}
    assert sum(offered.values()) == 40 and min(offered.values()) > 0
    assert Counter(s["group"] for s in run["samples"]) == offered
    for g in groups.values():
        assert g["summary"]["requests"] == g["summary"]["offered"] and g["summary"]["errors"] == {}
    assert sum(g["token_share"] for g in groups.values()) == pytest.approx(1.0)
    stats = gov.stats()
    tenants = {t["name"]: t["executed_total"] for t in stats["tenants"]}
    assert tenants == {"A": offered["A"], "B": offered["B/critical"], "default": 0}
    assert stats["classes"]["critical"]["executed_total"] == offered["B/critical"]


def test_tenant_tokens_open_each_tenants_own_connections(
    start_governor: Callable[..., Governor], tmp_path: Path
) -> None:
    tokens, secret_a, secret_b, default, wrong = (tmp_path / name for name in ("tokens", "a", "b", "default", "wrong"))
    tokens.write_text("A secret-a\nB secret-b\nthe-default-secret\n")
    for path, text in ((secret_a, "secret-a"), (secret_b, "secret-b"), (default, "the-default-secret")):
        path.write_text(text)
    wrong.write_text("not-the-secret")
    gov = start_governor("--auth-token-file", str(tokens), "--max-inflight", "64")
    gov.token = "the-default-secret"
    out = tmp_path / "tokens.json"
    flags = ("--num-requests", "30", "--connections", "2", "--auth-token-file", str(default))
    flags += ("--tenant-mix", "A=1,B=1,/sheddable=1", "--tenant-token", f"A={secret_a}")
    ok = run_bench(gov, *flags, "--tenant-token", f"B={secret_b}", "--json", str(out))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (run,) = json.loads(out.read_text())["runs"]
    groups = {g["group"]: g["summary"] for g in run["groups"]}
    assert list(groups) == ["A", "B", "/sheddable"] and sum(g["offered"] for g in groups.values()) == 30
    assert all(g["requests"] == g["offered"] for g in groups.values())
    # Each tenant's requests went over connections opened with its own secret: the governor
    # counted them under the tenant that secret names (the frames' tenant field matched it).
    executed = {t["name"]: t["executed_total"] for t in gov.stats()["tenants"]}
    assert executed == {
        "A": groups["A"]["offered"],
        "B": groups["B"]["offered"],
        "default": groups["/sheddable"]["offered"],
    }
    # Only B's connections open with the wrong secret, and the governor refuses them: the run
    # fails although the --auth-token-file (of the other connections and the stats poll) is right.
    refused = run_bench(gov, *flags, "--tenant-token", f"B={wrong}")
    assert refused.returncode == 1 and "carrying the right token" in refused.stderr, refused.stdout + refused.stderr
