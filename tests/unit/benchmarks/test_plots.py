"""benchmarks/plots.py and the page's pictures: each drawn from a result record alone (small ones
built here, not the committed files), the same bytes twice, and not drawn, with the page saying
why, when a record lacks what a picture needs."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from benchmarks import plots, report

MACHINE = {
    "cpu": "Test CPU 9000",
    "flags": ["avx2", "avx512f"],
    "cores": 2,
    "memory_gib": 8.0,
    "gpu": None,
    "system": "Linux x86_64",
    "python": "3.11.7",
    "torch": None,
}


def record(benchmark: str, details: dict[str, Any], figures: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    default = {"name": "a figure", "value": 1.0, "unit": "ms", "headline": True}
    return {
        "benchmark": benchmark,
        "part": None,
        "command": f"python -m benchmarks.{benchmark}",
        "commit": None,
        "dirty": False,
        "measures": ["governor"],
        "date": "2026-12-01T10:00:00+00:00",
        "wall_s": 1.0,
        "machine": MACHINE,
        "figures": figures or [default],
        "details": details,
    }


def sweep_point(pct: float, goodput: float, p99: float) -> dict[str, float]:
    return {"offered_pct": pct, "offered_rps": pct / 10, "goodput_rps": goodput, "ttft_p99_ms": p99}


def load_sweep() -> dict[str, Any]:
    points = {
        "--max-inflight 8": [sweep_point(50, 5.0, 40.0), sweep_point(150, 9.5, 50.0)],
        "unlimited": [sweep_point(50, 5.0, 45.0), sweep_point(150, 3.0, 2500.0)],
    }
    return record("admission.load_sweep", {"capacity_rps": 10.0, "slo_ttft_ms": 1000.0, "points": points})


def sdk_run(sent: int, completed: int, within: int, goodput: float) -> dict[str, Any]:
    return {"sent": sent, "completed": completed, "within_slo": within, "goodput_per_s": goodput}


def sdk_overload() -> dict[str, Any]:
    one = {
        "burst cold": {"direct": sdk_run(32, 32, 8, 1.0), "governor": sdk_run(32, 8, 8, 3.8)},
        "poisson": {"direct": sdk_run(200, 200, 15, 0.25), "governor": sdk_run(200, 80, 80, 3.7)},
    }
    rounds = [one, copy.deepcopy(one)]
    details = {"capacity_per_s": 4.0, "poisson_rate_per_s": 10.0, "slo_ms": 2000.0, "rounds": rounds}
    return record("peers.sdk_overload", details)


def llamacpp() -> dict[str, Any]:
    figures = [
        {"name": f"served tok/s, {dtype}, {load} workload", "value": ours, "unit": "tok/s",
         "baseline": "llama-server", "baseline_value": theirs, "ratio": ours / theirs, "headline": True}
        for dtype, load, ours, theirs in (("bfloat16", "uniform", 600.0, 430.0), ("float32", "mixed", 150.0, 85.0))
    ]  # fmt: skip
    details = {"bfloat16, uniform workload": {"paired_by_round": [1.3, 1.4, 1.5]}}
    return record("peers.llamacpp", details, figures)


def burst_run(accepted: int, scale: float) -> dict[str, Any]:
    quantiles = [scale * (1 + q) for q in range(101)]
    return {"accepted": accepted, "yielded": 256 - accepted, "ttft_quantiles_ms": quantiles}


def burst() -> dict[str, Any]:
    pairs = [{"unlimited": burst_run(256, 200.0 + i), "--max-inflight 64": burst_run(64, 60.0 + i)} for i in range(2)]
    return record("admission.burst", {"pairs": pairs})


def hint_policies() -> dict[str, Any]:
    def run(sent: int, within: int, within_horizon: int) -> dict[str, Any]:
        return {"sent": sent, "within_slo": within, "within_horizon": within_horizon}

    one = {
        load: {"server alone": run(sent, 4, 30), "ours": run(sent, 16, 16), "no hint": run(sent, 14, 15)}
        for load, sent in (("burst cold", 32), ("poisson", 130))
    }
    details = {"slo_ms": 2000.0, "horizon_ms": 10000.0, "poisson_rate_per_s": 8.7, "rounds": [one, copy.deepcopy(one)]}
    return record("peers.hint_policies", details)


RECORDS = {
    "admission.load_sweep": load_sweep,
    "peers.sdk_overload": sdk_overload,
    "peers.llamacpp": llamacpp,
    "admission.burst": burst,
    "peers.hint_policies": hint_policies,
}


@pytest.mark.parametrize("picture", plots.PICTURES, ids=lambda p: p.name)
def test_each_picture_is_drawn_from_its_record_alone_and_the_same_bytes_twice(picture: plots.Picture) -> None:
    rec = RECORDS[picture.benchmark]()
    first = plots.svg(picture, rec)
    assert first.startswith(b"<?xml") and b"<svg" in first
    assert first == plots.svg(picture, copy.deepcopy(rec)), "an unchanged result redraws byte for byte"
    text = first.decode()
    assert "Test CPU 9000 (avx2 avx512f), 2 cores" in text and "2026-12-01" in text, "the footer names the machine"
    assert f"python -m benchmarks.{picture.benchmark}" in text
    assert "Date" not in text.split("</metadata>")[0], "no date of drawing in the file"


def test_the_pictures_show_what_the_record_holds() -> None:
    sweep = plots.svg(plots.PICTURES[0], load_sweep()).decode()
    assert "governor --max-inflight 8" in sweep and "no cap (unlimited)" in sweep and "TTFT SLO (1000 ms)" in sweep
    tok_s = plots.svg(plots.PICTURES[2], llamacpp()).decode()
    assert "1.40×" in tok_s and "(1.30–1.50)" in tok_s, "the ratio, and its rounds' range where they are kept"
    assert "1.76×" in tok_s, "a case without rounds in its details still has its ratio"
    ttft = plots.svg(plots.PICTURES[3], burst()).decode()
    assert "--max-inflight 64: 64 served, 192 yielded at once" in ttft
    hints = plots.svg(plots.PICTURES[4], hint_policies()).decode()
    assert "TTFT ≤ 2 s" in hints and "TTFT ≤ 10 s" in hints, "a panel per SLO"
    assert "burst cold" in hints and "32 at once" in hints and "8.7 req/s" in hints and "no hint" in hints


@pytest.mark.parametrize(
    ("picture", "remove", "named"),
    [
        (0, ("details", "points", "unlimited"), "'unlimited'"),
        (0, ("details", "capacity_rps"), "details.capacity_rps"),
        (1, ("details", "rounds"), "details.rounds"),
        (3, ("details", "pairs", 0, "unlimited", "ttft_quantiles_ms"), "ttft_quantiles_ms"),
    ],
)
def test_a_record_without_a_field_its_picture_needs_is_not_drawn(
    picture: int, remove: tuple[str | int, ...], named: str
) -> None:
    p = plots.PICTURES[picture]
    rec = RECORDS[p.benchmark]()
    holder: Any = rec
    for step in remove[:-1]:
        holder = holder[step]
    del holder[remove[-1]]
    with pytest.raises(plots.Missing, match=named):
        plots.svg(p, rec)


def test_a_value_a_run_did_not_keep_is_missing_not_zero() -> None:
    rec = burst()
    rec["details"]["pairs"][1]["unlimited"]["ttft_quantiles_ms"][50] = None
    with pytest.raises(plots.Missing, match="ttft_quantiles_ms"):
        plots.svg(plots.PICTURES[3], rec)
    with pytest.raises(plots.Missing, match="served tok/s"):
        plots.svg(plots.PICTURES[2], record("peers.llamacpp", {}))


def test_the_page_embeds_the_pictures_drawn_and_says_which_command_keeps_the_rest(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    results, images = tmp_path / "results", tmp_path / "docs" / "img"
    without_quantiles = burst()
    for pair in without_quantiles["details"]["pairs"]:
        for run in pair.values():
            del run["ttft_quantiles_ms"]
    for rec in (load_sweep(), without_quantiles, llamacpp()):
        path = results / rec["benchmark"].replace(".", "/")
        path = path.with_name(path.name + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(rec))
    images.mkdir(parents=True)
    (images / "bench-burst.svg").write_text("<svg>an older picture</svg>")
    built = report.Page(report.load(results), tmp_path)

    drawn = report.pictures(built, images, tmp_path / "docs")
    text = report.render(built, drawn)

    assert "## Pictures" in text
    assert text.index("## Pictures") < text.index("## Every figure, by benchmark")
    caption = next(line for line in drawn if line.startswith("**Goodput and TTFT p99 against offered load"))
    assert "Test CPU 9000 (avx2 avx512f), 2 cores (M1) · 2026-12-01 **stale**[^" in caption
    assert "`python -m benchmarks.admission.load_sweep`" in caption and "(#admission-load-sweep)" in caption
    for name in ("bench-load-sweep", "bench-llamacpp"):
        assert f"](img/{name}.svg)" in text
        assert (images / f"{name}.svg").read_bytes().startswith(b"<?xml")
    skipped = next(line for line in drawn if line.startswith("- **TTFT distribution under a burst"))
    assert "not drawn: `admission/burst.json` has no `details.pairs.0.unlimited.ttft_quantiles_ms`" in skipped
    assert "`python -m benchmarks.admission.burst` (re-run) keeps it" in skipped
    assert not (images / "bench-burst.svg").exists(), "no picture of a result the page no longer has"
    absent = next(line for line in drawn if line.startswith("- **The openai SDK against llama-server"))
    assert "no result yet; `python -m benchmarks.peers.sdk_overload --rounds 3` produces it" in absent
    assert "](img/bench-burst.svg)" not in text and "](img/bench-sdk-overload.svg)" not in text

    before = (images / "bench-load-sweep.svg").stat().st_mtime_ns
    assert report.pictures(built, images, tmp_path / "docs") == drawn
    assert (images / "bench-load-sweep.svg").stat().st_mtime_ns == before, "an unchanged picture is not rewritten"
