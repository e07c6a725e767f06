"""The layers, read from the import statements of every module (including the ones inside functions
and under TYPE_CHECKING): who may import whom.

    govwire (the wire contract)   <- imported by all; imports only the stdlib and orjson
    governor.client               <- imports govwire; never the governor's server
    governor (the server)         <- imports govwire; never worker
      inside it, layers along the path of a frame (doors/, admission/, lifecycle.py, links/,
      fleet/), each importing only the layers below it (LAYERS: admission at the bottom, the doors
      at the top, doors and links never each other), and nothing importing the server shell (SHELL)
    worker                        <- imports govwire; never governor
      the engine core (engine, scheduler, runner, ...) never imports its adapters (worker.backends)
      the scheduler and its bookkeeping never import torch
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Iterator
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
            if target == "__future__":
                continue
            for alias in node.names:  # `from package import module` imports that module
                folder = ROOT.joinpath(*target.split("."), alias.name)
                is_module = folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file()
                yield Import(module, f"{target}.{alias.name}" if is_module else target, where)


# What the benchmarks write (built trees, other projects' venvs): not this project's code, and not walked.
GENERATED = (ROOT / "benchmarks" / "out",)


def imports_under(*packages: str) -> list[Import]:
    found: list[Import] = []
    for package in packages:
        for folder, dirs, files in os.walk(ROOT / package):
            dirs[:] = sorted(d for d in dirs if Path(folder, d) not in GENERATED)
            for name in sorted(files):
                if name.endswith(".py"):
                    found.extend(imports_of(Path(folder, name)))
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


# The governor's layers, bottom up: each imports govwire, itself and the layers it names, nothing
# else of the governor. A module is in the layer whose name is its longest prefix.
LAYERS: dict[str, frozenset[str]] = {
    "governor.latency": frozenset(),  # the histograms: everything records into them
    "governor.timers": frozenset(),  # where deadlines are set (the lobby's and the lifecycle's)
    "governor.doors.gateway_policy": frozenset(),  # which gateway headers the front door trusts: configuration
    # the decision, its limits, the appointments and the lobby: pure, timed through a Protocol
    "governor.admission": frozenset({"governor.latency", "governor.timers"}),
    "governor.fleet": frozenset({"governor.admission", "governor.latency"}),  # a lease is one more limit
    "governor.accounting": frozenset({"governor.admission"}),
    "governor.lifecycle": frozenset(
        {"governor.accounting", "governor.admission", "governor.latency", "governor.timers"}
    ),
    "governor.links": frozenset({"governor.lifecycle", "governor.admission"}),
    # the read side's one reading of the parts (stats, /metrics and `governor status` read it)
    "governor.report.snapshot": frozenset(
        {"governor.accounting", "governor.admission", "governor.latency", "governor.fleet"}
    ),
    "governor.state": frozenset(
        {
            "governor.report.snapshot",
            "governor.lifecycle",
            "governor.timers",
            "governor.accounting",
            "governor.admission",
            "governor.latency",
            "governor.fleet",
        }
    ),
    "governor.doors": frozenset(
        {
            "governor.state",
            "governor.lifecycle",
            "governor.accounting",
            "governor.admission",
            "governor.doors.gateway_policy",
        }
    ),
    "governor.report": frozenset(
        {
            "governor.report.snapshot",
            "governor.state",
            "governor.links",
            "governor.fleet",
            "governor.lifecycle",
            "governor.accounting",
            "governor.admission",
            "governor.latency",
        }
    ),
}
# What builds and runs the layers: it may import any of them, and nothing imports it.
SHELL = frozenset({"governor.__main__", "governor.shell"})


def in_shell(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in SHELL)


# Said once more as the rules a reader looks for: a table edit that allowed one of these fails too.
# (Pairs of layers; the two doors, in one layer, never import each other either.)
NEVER = [
    ("governor.admission", "governor.doors"),
    ("governor.admission", "governor.links"),
    ("governor.admission", "governor.lifecycle"),
    ("governor.admission", "governor.report"),
    ("governor.admission", "governor.fleet"),
    ("governor.links", "governor.doors"),
    ("governor.links", "governor.state"),
    ("governor.doors", "governor.links"),
    ("governor.lifecycle", "governor.doors"),
    ("governor.lifecycle", "governor.links"),
    ("governor.timers", "governor.lifecycle"),
    ("governor.timers", "governor.admission"),
]
DOORS = ("governor.doors.ndjson", "governor.doors.http")


def layer_of(module: str) -> str | None:
    matches = [name for name in LAYERS if module == name or module.startswith(name + ".")]
    return max(matches, key=len, default=None)


def server_modules() -> list[Path]:
    """The governor's own modules (its clients and bench are checked above)."""
    governor = ROOT / "governor"
    return [p for p in sorted(governor.rglob("*.py")) if p.relative_to(governor).parts[0] not in ("client", "bench")]


def test_every_module_of_the_server_is_in_a_layer_or_the_shell() -> None:
    stray = [
        m for m in map(module_name, server_modules()) if m != "governor" and layer_of(m) is None and not in_shell(m)
    ]
    assert not stray, f"place these in LAYERS or SHELL: {stray}"


def layer_violations(imports: Iterable[Import]) -> list[str]:
    bad = []
    for i in imports:
        own = layer_of(i.module)
        if own is None or i.top != "governor":
            continue  # the shell imports anything
        target = layer_of(i.target)
        if target != own and target not in LAYERS[own]:
            outside = "the clients" if i.target.startswith(("governor.client", "governor.bench")) else "the shell"
            bad.append(f"{i.where}: {i.module} ({own}) imports {i.target} ({target or outside})")
        elif i.module in DOORS and i.target in DOORS and i.target != i.module:
            bad.append(f"{i.where}: the door {i.module} imports the door {i.target}")
    return bad


def shell_violations(imports: Iterable[Import]) -> list[str]:
    return [
        f"{i.where}: {i.module} imports {i.target}" for i in imports if in_shell(i.target) and not in_shell(i.module)
    ]


def test_each_layer_imports_only_the_layers_below_it() -> None:
    bad = layer_violations(i for path in server_modules() for i in imports_of(path))
    assert not bad, "\n".join(bad)


def test_the_layers_are_an_order_and_the_never_rules_hold() -> None:
    graph = {name: set(allowed) for name, allowed in LAYERS.items()}
    assert _find_cycle(graph) is None
    allowed_transitively = {name: _reachable(graph, name) for name in LAYERS}
    assert [(a, b) for a, b in NEVER if b in allowed_transitively[a]] == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = list(graph[start])
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return seen


def test_nothing_imports_the_server_shell() -> None:
    bad = shell_violations(imports_under("governor", "govwire", "worker"))
    assert not bad, "\n".join(bad)


def test_the_layer_rules_can_fail() -> None:
    # A rule that could not fail would prove nothing: each check must see a wrong import.
    assert layer_violations([Import("governor.doors.http", "governor.links.upstream", "x.py:1")]) == [
        "x.py:1: governor.doors.http (governor.doors) imports governor.links.upstream (governor.links)"
    ]
    assert layer_violations([Import("governor.admission.pool", "governor.shell.config", "x.py:2")]) == [
        "x.py:2: governor.admission.pool (governor.admission) imports governor.shell.config (the shell)"
    ]
    assert layer_violations([Import("governor.doors.http", "governor.admission.limits", "x.py:3")]) == []
    assert layer_violations([Import("governor.doors.http", "governor.doors.ndjson", "x.py:6")]) != []
    assert layer_violations([Import("governor.links.upstream", "governor.client", "x.py:7")]) != []
    assert {i.target for i in imports_of(ROOT / "governor" / "__main__.py")} == {"governor.shell.cli"}
    assert shell_violations([Import("governor.links.upstream", "governor.shell.server", "x.py:4")]) != []
    assert shell_violations([Import("governor.shell.server", "governor.shell.config", "x.py:5")]) == []


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
        "import sys, governor.shell.cli, governor.shell.server, governor.client, governor.bench.main; "
        "print(sorted(m for m in ('torch', 'transformers', 'worker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def modules_loaded_by(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules named `prefixes...` that `statement` loads in a fresh interpreter."""
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded: list[str] = ast.literal_eval(out.stdout.strip())
    return loaded


def test_what_the_old_wrong_way_imports_pulled_in_stays_out() -> None:
    # The state names the fleet member as a type only: importing it needs no Redis client.
    assert modules_loaded_by("import governor.state", ("redis", "governor.fleet.member")) == []
    # OpenAITarget sits beside EndpointLimits: the configuration needs no link, door or lifecycle
    # (only the doors' own configuration, the gateway policy, which imports nothing).
    loaded = modules_loaded_by(
        "import governor.shell.config", ("governor.links", "governor.doors", "governor.lifecycle")
    )
    assert loaded == ["governor.doors", "governor.doors.gateway_policy"]
    assert modules_loaded_by("import governor.shell.server", ("redis",)) != []  # the check sees what is loaded


def test_the_echo_worker_starts_without_torch(tmp_path: Path) -> None:
    """The echo engine needs no model: its worker must start without importing torch or transformers
    (about 2 s of CPU each, and the suite starts a few hundred echo workers). Every module the
    process imports until it listens is read from `-X importtime`."""
    socket_path = tmp_path / "echo.sock"
    argv = [sys.executable, "-X", "importtime", "-m", "worker", "serve", "--engine", "echo"]
    proc = subprocess.Popen([*argv, "--listen", f"unix:{socket_path}"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the echo worker did not start"
            time.sleep(0.05)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    imported = {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}
    assert "worker.service" in imported, "the walk saw the worker's own modules"
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers")}


def registry_reaches(path: Path) -> list[str]:
    """Where a door decides or reaches into the appointments itself (admission's and the shared
    decision step's work): a call of `decide` or `identify`, a read of the registry's
    `appointments`, `by_ticket` or `lapsed`, or an import of the registry."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in (
            "decide",
            "identify",
            "appointments",
            "by_ticket",
            "lapsed",
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    found += [f"{i.where}: imports {i.target}" for i in imports_of(path) if ".appointments.registry" in i.target]
    return found


@pytest.mark.parametrize("door", DOORS)
def test_no_door_decides_or_reads_the_appointment_registry(door: str) -> None:
    # One decision step for both doors (doors/shared.py): a feature around `decide` is written once.
    assert registry_reaches(ROOT.joinpath(*door.split(".")).with_suffix(".py")) == []


def test_the_registry_check_sees_a_door_that_reaches_in(tmp_path: Path) -> None:
    sample = ROOT / "governor" / "doors" / "_sample_door.py"
    sample.write_text(
        "from governor.admission.appointments.registry import identity_of\n"
        "def f(state, ask):\n"
        "    state.admission.appointments.identify(1, 2)\n"
        "    return state.admission.decide(0, ask)\n"
    )
    try:
        assert len(registry_reaches(sample)) == 4
    finally:
        sample.unlink()


MAY_IMPORT = re.compile(r"May import:(.*?)\.(?:\s|$)", re.DOTALL)
NAMED = re.compile(r"\bgovwire\b|(?:\b[a-z_]+/)+(?:[a-z_]+\.py)?|\b[a-z_]+\.py\b")


def doc_name(layer: str) -> str:
    """How a package's docstring names a layer: `admission/`, `latency.py`, `doors/gateway_policy.py`."""
    path = ROOT.joinpath(*layer.split("."))
    return "/".join(layer.split(".")[1:]) + ("/" if path.is_dir() else ".py")


def said_to_import(package: str) -> set[str]:
    """The names in the "May import:" sentence of a package's docstring."""
    doc = ast.get_docstring(ast.parse((ROOT.joinpath(*package.split(".")) / "__init__.py").read_text())) or ""
    found = MAY_IMPORT.search(doc)
    assert found, f"{package}'s docstring says nothing of what it may import"
    return set(NAMED.findall(found.group(1)))


PACKAGE_LAYERS = [name for name in LAYERS if (ROOT.joinpath(*name.split(".")) / "__init__.py").is_file()]


@pytest.mark.parametrize("package", PACKAGE_LAYERS)
def test_each_packages_docstring_says_what_the_table_allows_it_to_import(package: str) -> None:
    allowed = {doc_name(layer) for layer in LAYERS[package] if not layer.startswith(package + ".")}
    assert said_to_import(package) == allowed | {"govwire"}


@pytest.mark.parametrize("package", [*PACKAGE_LAYERS, "governor.shell", "governor.admission.appointments"])
def test_each_packages_docstring_names_its_modules(package: str) -> None:
    folder = ROOT.joinpath(*package.split("."))
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    parts = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
    parts += [f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()]
    assert [name for name in sorted(parts) if name not in doc] == []


def test_the_docstring_reader_finds_the_names() -> None:
    text = "x. May import: govwire, admission/, doors/gateway_policy.py and latency.py (the histograms). Never links/."
    assert set(NAMED.findall(MAY_IMPORT.search(text).group(1))) == {  # type: ignore[union-attr]
        "govwire",
        "admission/",
        "doors/gateway_policy.py",
        "latency.py",
    }
    assert doc_name("governor.report.snapshot") == "report/snapshot/" and doc_name("governor.latency") == "latency.py"
