"""benchmarks/report.py: the current-figures page, the staleness of a result, and the committed results."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from benchmarks import report
from benchmarks.harness.results import ROOT, Machine


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    git(repo, "add", path)
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"change {path}")
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    return tmp_path


def record(commit_: str | None, measures: list[str], **extra: Any) -> dict[str, Any]:
    machine = Machine("AMD EPYC", ("avx2",), 2, 23.5, None, "Linux x86_64", "3.11.7", None)
    return {
        "benchmark": "cost.example",
        "part": None,
        "command": "python -m benchmarks.cost.example",
        "commit": commit_,
        "dirty": False,
        "measures": measures,
        "date": "2026-11-27T15:00:00+00:00",
        "wall_s": 1.0,
        "machine": machine.__dict__ | {"flags": list(machine.flags)},
        "figures": [
            {"name": "refusals/s", "value": 61234.5, "unit": "frames/s", "baseline": "bare server",
             "baseline_value": 80000.0, "ratio": 0.765, "difference": None, "bar": ">= 0.9x", "met": False,
             "headline": True, "note": ""},
            {"name": "a detail", "value": 1.0, "unit": "ms", "baseline": None, "baseline_value": None,
             "ratio": None, "difference": None, "bar": None, "met": None, "headline": False, "note": ""},
        ],
        "details": {},
    } | extra  # fmt: skip


def test_a_result_is_stale_once_a_later_commit_changes_what_it_measures(repo: Path) -> None:
    taken = commit(repo, "governor/admission.py", "v1")
    assert not report.freshness(record(taken, ["governor"]), repo).stale
    commit(repo, "docs/page.md", "words")
    assert not report.freshness(record(taken, ["governor"]), repo).stale, "a docs commit changes no figure"
    commit(repo, "worker/engine.py", "v2")
    assert not report.freshness(record(taken, ["governor"]), repo).stale, "nor a change to what it does not measure"
    later = report.freshness(record(taken, ["governor", "worker"]), repo)
    assert later.stale and "1 later commit(s) changed governor/, worker/" in later.why
    commit(repo, "governor/admission.py", "v2")
    assert "2 later commit(s)" in report.freshness(record(taken, ["governor", "worker"]), repo).why


def test_a_result_with_uncommitted_or_unknown_code_is_stale(repo: Path) -> None:
    taken = commit(repo, "governor/admission.py", "v1")
    dirty = report.freshness(record(taken, ["governor"], dirty=True), repo)
    assert dirty.stale and "uncommitted" in dirty.why
    for unknown in (None, "0" * 40):
        assert report.freshness(record(unknown, ["governor"]), repo).stale


def test_the_page_opens_with_a_row_per_result_and_lists_every_figure_below(repo: Path, tmp_path: Path) -> None:
    taken = commit(repo, "governor/admission.py", "v1")
    path = tmp_path / "results" / "cost" / "example.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(orjson.dumps(record(taken, ["governor"])))
    results = report.load(tmp_path / "results")

    fresh = report.page(results, repo)
    summary, _, below = fresh.partition("## Every figure, by benchmark")
    row = next(line for line in summary.splitlines() if line.startswith("| [refusals/s]"))
    assert [c.strip() for c in row.strip("|").split(" | ")] == [
        "[refusals/s](#cost-example)", "61,234 frames/s", "bare server: 80,000 frames/s", "0.765×",
        ">= 0.9x: missed", "M1", "2026-11-27", "`python -m benchmarks.cost.example`",
    ]  # fmt: skip
    assert "a detail" not in summary, "the one-screen table has the first headline figure of each result"
    assert "| **cost/** — the governor's own cost |" in summary
    assert "- **M1**: Linux x86_64, 2 cores (AMD EPYC; avx2), Python 3.11.7, 23.5 GiB" in summary
    assert "**stale**[" not in fresh
    assert "`python -m benchmarks.cost.yield_throughput`" in summary, "benchmarks without a result are listed"
    assert '<a id="cost-example"></a>' in below and "### cost/example" in below
    assert "| refusals/s | 61,234 frames/s | bare server: 80,000 frames/s | 0.765× | >= 0.9x: missed |  |" in below
    assert "| a detail | 1 ms |  |  |  |  |" in below

    commit(repo, "governor/admission.py", "v2")
    stale = report.page(results, repo)
    assert "2026-11-27 **stale**[^1]" in stale
    assert re.search(r"\[\^1\]: `cost/example.json`: 1 later commit\(s\) changed governor/", stale)


def test_numbers_are_short() -> None:
    assert [report.number(x) for x in (61234.5, 123.4, 12.34, 1.234, 0.01234, 3.0, None)] == [
        "61,234", "123", "12.3", "1.23", "0.0123", "3", "–",
    ]  # fmt: skip
    assert report.quantity(98.0, "%") == "98%" and report.quantity(1.5, "x") == "1.50×"
    assert report.comparison({"ratio": None, "difference": 0.301, "unit": "ms"}) == "+0.301 ms"
    assert report.comparison({"ratio": None, "difference": -12.5, "unit": "ms"}) == "−12.5 ms"
    assert report.comparison({"ratio": 0.5, "difference": None, "unit": "ms"}) == "0.500×"
    assert report.number(1.004) == "1.00", "not whole, so not written as 1"


# The committed results and the page built from them: what HEAD holds, not what a local run left
# in the working tree (a benchmark rewrites its file; `make bench-report` and a commit follow).


def committed(path: str) -> bytes | None:
    out = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True)
    return out.stdout if out.returncode == 0 else None


def committed_results() -> list[report.Result]:
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", "HEAD", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True
    )
    paths = [p for p in listed.stdout.split() if p.endswith(".json")] if listed.returncode == 0 else []
    return [report.Result(ROOT / p, orjson.loads(committed(p) or b"{}")) for p in paths]


COMMITTED = committed_results()
PAGE = (committed("docs/BENCHMARKS.md") or b"").decode()
needs_history = pytest.mark.skipif(not PAGE, reason="no git history here to read the committed page from")


@pytest.mark.parametrize("result", COMMITTED, ids=lambda r: r.path.name)
def test_every_committed_result_is_complete_and_rerunnable(result: report.Result) -> None:
    r = result.record
    module = str(r["benchmark"])
    folder, _, name = module.partition(".")
    assert (ROOT / "benchmarks" / folder / f"{name}.py").exists(), f"{module}: no such benchmark"
    assert r["command"].startswith(f"python -m benchmarks.{module}"), r["command"]
    assert result.path.name == (f"{name}-{r['part']}.json" if r["part"] else f"{name}.json")
    assert r["commit"] and r["machine"]["cpu"] and r["machine"]["cores"] >= 1
    assert set(r["measures"]) <= {"govwire", "governor", "worker"} and r["measures"]
    assert any(f["headline"] for f in r["figures"]), "a result with nothing for the page"
    for f in r["figures"]:
        assert f["name"] and f["unit"] is not None
        if f["ratio"] is not None and f["value"] is not None and f["baseline_value"]:
            assert f["baseline"], f"{f['name']}: a ratio against nothing named"


@needs_history
def test_the_committed_page_has_every_committed_result() -> None:
    """`make bench-report` was run (and committed) after the last result was committed: the summary
    has each result's first headline figure, and the rest of the page every figure."""
    summary, _, below = PAGE.partition("## Every figure, by benchmark")
    for result in COMMITTED:
        figures = result.record["figures"]
        first = next(f for f in figures if f["headline"])
        cells = f"| [{first['name']}](#{report.anchor(result)}) | {report.quantity(first['value'], first['unit'])} |"
        assert cells in summary, f"{result.path.name}: not in the summary table: run `make bench-report`"
        for f in figures:
            row = f"| {f['name']} | {report.quantity(f['value'], f['unit'])} |"
            assert row in below, f"{result.path.name}: {row} not on the page: run `make bench-report`"


@needs_history
def test_every_benchmark_has_a_committed_result() -> None:
    """benchmarks/results/ keeps the latest result of every benchmark: a new one is run before it lands."""
    measured = {str(r.record["benchmark"]) for r in COMMITTED}
    for folder, names in report.benchmark_modules().items():
        for name in names:
            assert f"{folder}.{name}" in measured, f"benchmarks/{folder}/{name}.py has no committed result"


def test_every_benchmark_command_in_the_docs_exists() -> None:
    """The commands in the README, the docs and the Makefile name modules that exist, and the
    make targets the docs name are defined."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    texts = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in texts:
        text = path.read_text()
        for module in re.findall(r"-m (benchmarks(?:\.[a-z_]+)+)", text):
            file = ROOT / (module.replace(".", "/") + ".py")
            assert file.exists(), f"{path.name}: python -m {module}: no such module"
        for target in re.findall(r"`make ([a-z][a-z0-9-]*[a-z0-9])\b(?![-*{])", text):
            assert target in targets, f"{path.name}: make {target}: no such target"
