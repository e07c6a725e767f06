"""The layers, read from the import statements of every module (including the ones inside functions
and under TYPE_CHECKING): who may import whom.

    govwire (the wire contract)   <- imported by all; imports only the stdlib and orjson
    governor.client               <- imports govwire; never the governor's server
    governor (the server)         <- imports govwire; never worker
    worker                        <- imports govwire; never governor
      the engine core (engine, scheduler, runner, ...) never imports its adapters (worker.backends)
      the scheduler and its bookkeeping never import torch
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STDLIB = sys.stdlib_module_names


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted (absolute)
    where: str  # path:line, for the failure message

    @property
    def top(self) -> str:
        return self.target.partition(".")[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> Iterator[Import]:
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, where)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target != "__future__":
                yield Import(module, target, where)


def imports_under(*packages: str) -> list[Import]:
    found: list[Import] = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.extend(imports_of(path))
    return found


def violations(imports: list[Import], allowed: set[str]) -> list[str]:
    return [f"{i.where}: {i.module} imports {i.target}" for i in imports if i.top not in allowed]


def test_the_walker_sees_imports_in_functions_and_under_type_checking(tmp_path: Path) -> None:
    # A check that could not fail would prove nothing: the walker must find every form.
    sample = ROOT / "worker" / "service.py"
    found = {i.target for i in imports_of(sample)}
    assert {"govwire.codec", "worker.backends.echo", "worker.backends.gpt2"} <= found  # the last two: lazy
    assert violations([Import("worker.x", "governor.state", "x.py:1")], {"worker", "govwire"}) == [
        "x.py:1: worker.x imports governor.state"
    ]


def test_the_contract_imports_only_the_stdlib_orjson_and_itself() -> None:
    bad = violations(imports_under("govwire"), STDLIB | {"orjson", "govwire"})
    assert not bad, "\n".join(bad)


def test_the_worker_never_imports_the_governor() -> None:
    bad = [f"{i.where}: {i.module} imports {i.target}" for i in imports_under("worker") if i.top == "governor"]
    assert not bad, "\n".join(bad)


def test_the_governor_never_imports_the_worker() -> None:
    # It spawns `python -m worker` as a process; it never imports it.
    bad = [f"{i.where}: {i.module} imports {i.target}" for i in imports_under("governor") if i.top == "worker"]
    assert not bad, "\n".join(bad)


def test_the_client_imports_the_contract_and_not_the_server() -> None:
    imports = imports_under("governor/client")
    bad = [
        f"{i.where}: {i.module} imports {i.target}"
        for i in imports
        if i.top not in STDLIB | {"orjson", "govwire"} and not i.target.startswith("governor.client")
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "core", ["engine", "scheduler", "sequence", "runner", "model", "block_manager", "kv_cache", "attention"]
)
def test_the_engine_core_does_not_import_its_adapters(core: str) -> None:
    bad = [
        f"{i.where}: {i.module} imports {i.target}"
        for i in imports_of(ROOT / "worker" / f"{core}.py")
        if i.target.startswith(("worker.backends", "worker.service"))
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("bookkeeping", ["scheduler", "sequence", "block_manager"])
def test_the_scheduler_and_its_bookkeeping_need_no_torch(bookkeeping: str) -> None:
    imported = {i.top for i in imports_of(ROOT / "worker" / f"{bookkeeping}.py")}
    assert "torch" not in imported


def test_no_import_cycles_among_the_governors_modules() -> None:
    """Including imports only for type checking: a cycle there is a module that knows too much."""
    graph: dict[str, set[str]] = {}
    for i in imports_under("governor", "govwire"):
        if i.top in ("governor", "govwire") and i.target != i.module:
            graph.setdefault(i.module, set()).add(i.target)
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_governor_and_its_clients_run_without_the_workers_dependencies() -> None:
    """torch and transformers are the `worker` extra (pyproject.toml): the governor's own modules
    must not need them, or a governor-only install would not start."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("torch", "transformers"))]
    assert {d.split(">")[0] for d in project["optional-dependencies"]["worker"]} == {"torch", "transformers"}
    code = (
        "import sys, governor.cli, governor.server, governor.client, governor.bench.main; "
        "print(sorted(m for m in ('torch', 'transformers', 'worker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
