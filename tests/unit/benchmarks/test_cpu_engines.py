"""benchmarks/peers/cpu_engines.py's sides and figures on made-up rounds (the benchmark itself runs
the real servers): side names with their suffixes, and which figure a side is held to."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness.results import RESULTS_ENV, Sitting
from benchmarks.peers.cpu_engines import record, side_named


def test_a_side_s_suffixes_set_its_kv_dtype_threads_and_tree() -> None:
    side = side_named("governor int8 with KV float32 on 1 thread at baseline")
    assert (side.server, side.precision, side.kv_dtype, side.threads, side.at_baseline) == (
        "governor",
        "int8",
        "float32",
        1,
        True,
    )
    plain = side_named("governor float32")
    assert (plain.kv_dtype, plain.threads, plain.at_baseline) == (None, None, False)
    assert side_named("vLLM float32 on 2 threads").threads == 2


@pytest.mark.parametrize("name", ["llama-server f32 at baseline", "vLLM float32 with KV bfloat16", "governor int4"])
def test_a_side_no_server_can_run_is_refused_by_name(name: str) -> None:
    with pytest.raises(SystemExit, match="unknown side"):
        side_named(name)


def test_a_baseline_side_is_set_beside_its_twin_and_held_to_no_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    sides = [side_named(n) for n in ("governor float32", "governor float32 at baseline", "vLLM float32")]
    per_round = [(300.0, 250.0, 290.0), (310.0, 260.0, 300.0), (290.0, 240.0, 310.0)]
    results = [{s.name: {"uniform": tok_s} for s, tok_s in zip(sides, r, strict=True)} for r in per_round]
    sitting = Sitting(("worker",), name="peers.cpu_engines", command="python -m benchmarks.peers.cpu_engines")
    rows = record(sitting, sides, ["uniform"], results)
    figures = {f.name: f for f in sitting.figures}
    now = figures["served tok/s, governor float32 vs the fastest peer, uniform workload"]  # vLLM float32, the only peer
    assert (now.bar, now.met) == (">= 1.0x", True)  # paired ratios 300/290, 310/300, 290/310: median 1.033
    assert now.ratio == pytest.approx(310 / 300)
    before = figures["served tok/s, governor float32 at baseline vs the fastest peer, uniform workload"]
    assert before.bar is None and before.met is None
    against = {row[1]: row[3] for row in rows}
    assert "governor float32 at baseline 1.20x" in against["governor float32"]  # 300/250, 310/260, 290/240
