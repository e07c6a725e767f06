"""benchmarks/harness/results.py: what a result file holds, and the machine it names."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from benchmarks.harness.results import RESULTS_ENV, VECTOR_FLAGS, Machine, Sitting, benchmark_name


def sitting(**kwargs: object) -> Sitting:
    return Sitting(name="cost.example", command="python -m benchmarks.cost.example --rounds 1", **kwargs)  # type: ignore[arg-type]


def test_a_result_file_holds_the_figures_their_baselines_and_the_sitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    s = sitting(measures=("governor", "govwire"))
    s.figure("refusals/s", 75.0, "frames/s", baseline=("bare server", 100.0), bar=">= 0.9x", met=False)
    s.figure("paired", 2.0, "ms", baseline=("direct", 1.0), ratio=1.8)
    s.figure("RSS", 30.5, "MiB", headline=False)
    s.figure("TTFT p99 through it", 1.2, "ms", baseline=("direct", 0.9), difference=0.28)
    s.details["rounds"] = [{"governor": 75.0, "bare": 100.0}]
    path = s.write()

    assert path == tmp_path / "cost" / "example.json"
    record = orjson.loads(path.read_bytes())
    assert record["benchmark"] == "cost.example"
    assert record["command"] == "python -m benchmarks.cost.example --rounds 1"
    assert record["measures"] == ["governor", "govwire"]
    assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool)
    assert record["date"][:4].isdigit() and record["wall_s"] >= 0
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"]
    first, second, third, fourth = record["figures"]
    assert first["ratio"] == 0.75 and first["baseline"] == "bare server" and first["baseline_value"] == 100.0
    assert (first["bar"], first["met"], first["headline"]) == (">= 0.9x", False, True)
    assert second["ratio"] == 1.8  # the benchmark's own estimate (a median of per-round ratios) is kept
    assert third["baseline"] is None and third["ratio"] is None and third["headline"] is False
    assert fourth["ratio"] is None and fourth["difference"] == 0.28, "what is added is not divided"
    assert record["details"] == {"rounds": [{"governor": 75.0, "bare": 100.0}]}


def test_parts_write_files_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    s = sitting(measures=("worker",), part="uniform")
    s.figure("tok/s", 1.0, "tok/s")
    assert s.write() == tmp_path / "cost" / "example-uniform.json"


def test_a_sitting_names_what_it_measures_and_has_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="measures"):
        sitting(measures=("benchmarks",))
    with pytest.raises(ValueError, match="measures"):
        sitting(measures=())
    with pytest.raises(ValueError, match="no figures"):
        sitting(measures=("worker",)).write()
    assert not list(tmp_path.iterdir())


def test_the_benchmark_is_named_by_the_module_run_with_python_m() -> None:
    with pytest.raises(RuntimeError, match="python -m benchmarks"):
        benchmark_name()  # under pytest, __main__ is not a benchmark


def machine(flags: tuple[str, ...], gpu: str | None = None) -> Machine:
    return Machine("AMD EPYC", flags, 2, 23.5, gpu, "Linux x86_64", "3.11.7", "2.13.0+cpu")


def test_the_machine_line_names_the_cpu_its_vector_flags_and_the_gpu() -> None:
    assert machine(("avx2", "avx512_bf16")).line() == (
        "Linux x86_64, 2 cores (AMD EPYC; avx2 avx512_bf16), Python 3.11.7, torch 2.13.0+cpu"
    )
    assert machine((), gpu="NVIDIA H200").line() == (
        "Linux x86_64, 2 cores (AMD EPYC; no vector flags), NVIDIA H200, Python 3.11.7, torch 2.13.0+cpu"
    )


def test_this_machine_is_read_from_the_system() -> None:
    here = Machine.here()
    assert here.cores >= 1 and here.memory_gib > 0 and here.python
    assert set(here.flags) <= set(VECTOR_FLAGS)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        listed = next(
            (
                line.split(":", 1)[1].split()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith(("flags", "Features"))
            ),
            [],
        )
        assert set(here.flags) == set(VECTOR_FLAGS) & set(listed)
