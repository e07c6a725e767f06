"""Who the benchmarks may import, read from their import statements (tests/unit/test_layers.py's
walker, which sees imports inside functions too):

    tests/                          <- never imported by a benchmark: what both share lives in
                                       benchmarks/harness/fixtures/
    benchmarks/harness/             <- imported by every benchmark; imports no benchmark
    benchmarks/{peers,cost,...}/    <- each group imports the harness and its own scripts, never
                                       another group's (a helper two groups need goes to the harness)
"""

from __future__ import annotations

from tests.unit.test_layers import ROOT, Import, imports_under

HARNESS = "benchmarks.harness"
GROUPS = ("peers", "cost", "admission", "engine", "robustness")
# A group's import of another group's script that must stay, with the reason; none today.
ALLOWED_ACROSS: dict[tuple[str, str], str] = {}


def group_of(module: str) -> str | None:
    """The benchmark group a dotted module name is in, "harness", or None (outside the groups)."""
    parts = module.split(".")
    if parts[0] != "benchmarks" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in (*GROUPS, "harness") else None


def into_tests(imports: list[Import]) -> list[str]:
    return [f"{i.where}: {i.module} imports {i.target}" for i in imports if i.top == "tests"]


def crossings(imports: list[Import]) -> list[str]:
    """Imports from a benchmark group into another group, and from the harness into any group."""
    found = []
    for i in imports:
        source, target = group_of(i.module), group_of(i.target)
        if source is None or target is None or target == "harness" or source == target:
            continue
        if (source, target) not in ALLOWED_ACROSS:
            found.append(f"{i.where}: {i.module} imports {i.target}")
    return found


def benchmark_imports() -> list[Import]:
    """The imports of the benchmarks' own modules (imports_under leaves out what they write under
    benchmarks/out/, such as refusal_ab's extracted baseline trees and vLLM's venv)."""
    return imports_under("benchmarks")


def test_no_benchmark_imports_the_tests() -> None:
    assert into_tests(benchmark_imports()) == []


def test_benchmark_groups_import_the_harness_not_each_other() -> None:
    assert crossings(benchmark_imports()) == []


def test_the_groups_listed_are_the_folders_there() -> None:
    folders = {p.parent.name for p in (ROOT / "benchmarks").glob("*/__init__.py")}
    assert folders == {*GROUPS, "harness"}, "a new benchmark folder: add it to GROUPS"


def test_the_rules_can_fail() -> None:
    imports = [
        Import("benchmarks.peers.llamacpp", "benchmarks.engine.engine_vs_hf", "a:1"),
        Import("benchmarks.harness.common", "benchmarks.cost.http_front", "b:1"),
        Import("benchmarks.engine.gpu", "benchmarks.engine.engine_vs_hf", "c:1"),
        Import("benchmarks.cost.http_front", "benchmarks.harness.fixtures.redis_server", "d:1"),
        Import("benchmarks.report", "benchmarks.plots", "e:1"),
        Import("benchmarks.admission.fleet", "tests.redis_server", "f:1"),
    ]
    assert crossings(imports) == [
        "a:1: benchmarks.peers.llamacpp imports benchmarks.engine.engine_vs_hf",
        "b:1: benchmarks.harness.common imports benchmarks.cost.http_front",
    ]
    assert into_tests(imports) == ["f:1: benchmarks.admission.fleet imports tests.redis_server"]
