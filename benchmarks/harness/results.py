"""One result file per benchmark run: its figures, and what it takes to trust them again later.

A number in a document outlives the code and the machine that produced it. So every benchmark
ends by writing `benchmarks/results/<folder>/<name>.json` (one file per part for the scripts whose
parts run on their own, e.g. `peers/proxies-refusals.json`) holding:

- the figures: each a value with its unit, and for a comparison the baseline it was measured
  beside **in the same sitting** (name and value) and the ratio between them; the bar it is held
  to, if any, and whether it was met; `headline` figures go on the current-figures page;
- the command line that produced them, the commit (and whether the measured packages had
  uncommitted changes), the date, how long the run took;
- the machine: CPU model and vector flags, cores, memory, GPU if any, Python and torch versions.

The latest committed file of each benchmark is the one `python -m benchmarks.report` (`make
bench-report`) builds docs/BENCHMARKS.md from; a result whose commit is older than the last change
to a package it `measures` is marked stale there. Raw outputs (logs, plots, per-request samples)
go to benchmarks/out/, which is not committed.

    sitting = Sitting(measures=("governor", "govwire"))
    sitting.figure("refusals/s, 4 connections", rate, "frames/s", baseline=("bare server", bare_rate))
    sitting.write()

`GOVERNOR_BENCH_RESULTS=DIR` writes the files under DIR instead (a trial run that should not
replace the committed result). Where the tree is a copy whose git history is not this one's (a
lent GPU machine gets the working tree with the history it started from), `GOVERNOR_BENCH_COMMIT=SHA`
names the commit the copy is clean at.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_ENV = "GOVERNOR_BENCH_RESULTS"
COMMIT_ENV = "GOVERNOR_BENCH_COMMIT"
PACKAGES = ("govwire", "governor", "worker")  # what a figure can measure

# The CPU features that decide which kernels run (oneDNN's, llama.cpp's, ours): enough to tell an
# AVX2-only Zen 3 from an AVX512-BF16 Zen 4 or an AMX Xeon, which is what makes two absolute
# figures comparable or not.
VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "asimd",
    "sve",
    "bf16",
)


@dataclass(frozen=True)
class Figure:
    """One measured number. A comparison names its baseline, measured beside it in the same sitting,
    and compares by `ratio` (value / baseline, unless the benchmark computed a better estimate: the
    median of per-round ratios, which cancels the drift between rounds) or, for what is added to a
    baseline (latency through the governor against straight to the worker), by `difference` (the
    median of per-round differences, in the figure's unit)."""

    name: str
    value: float | None
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    ratio: float | None = None
    difference: float | None = None
    bar: str | None = None  # the target, in words: "ratio >= 0.9", "<= 2 ms"
    met: bool | None = None
    headline: bool = True
    note: str = ""


@dataclass(frozen=True)
class Machine:
    cpu: str
    flags: tuple[str, ...]
    cores: int
    memory_gib: float
    gpu: str | None
    system: str
    python: str
    torch: str | None

    @classmethod
    def here(cls) -> Machine:
        cpu = "unknown CPU"
        flags: tuple[str, ...] = ()
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            info = ""
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu == "unknown CPU":
                cpu = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                present = set(value.split())
                flags = tuple(f for f in VECTOR_FLAGS if f in present)
        try:
            torch: str | None = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch = None
        return cls(
            cpu=cpu,
            flags=flags,
            cores=os.cpu_count() or 0,  # the machine's, not this process's affinity (some benchmarks pin)
            memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            gpu=gpu_name(),
            system=f"{platform.system()} {platform.machine()}",
            python=platform.python_version(),
            torch=torch,
        )

    def line(self) -> str:
        """The one-line description the scripts print above their tables."""
        parts = [f"{self.system}, {self.cores} cores ({self.cpu}; {' '.join(self.flags) or 'no vector flags'})"]
        if self.gpu:
            parts.append(self.gpu)
        parts.append(f"Python {self.python}")
        if self.torch:
            parts.append(f"torch {self.torch}")
        return ", ".join(parts)


def gpu_name() -> str | None:
    """The first GPU `nvidia-smi` lists, without importing torch (which a governor benchmark lacks)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return f"{len(names)}x {names[0]}" if len(names) > 1 else (names[0] if names else None)


def git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def baseline_tree(path: str | None) -> tuple[str, Path] | None:
    """A benchmark's `--baseline-tree` (a checkout of an earlier commit, e.g. a `git worktree`, whose
    governor runs beside this one's as `python -m governor` from that directory): its label
    (`before <commit>`, `(dirty)` where its code differs from the commit) and path, or None."""
    if path is None:
        return None
    tree = Path(path).resolve()
    if not (tree / "governor").is_dir():
        raise SystemExit(f"--baseline-tree {path}: no governor/ there")
    commit = git("rev-parse", "--short", "HEAD", cwd=tree) or "?"
    dirty = " (dirty)" if git("status", "--porcelain", "--", "governor", "govwire", "worker", cwd=tree) else ""
    return f"before {commit}{dirty}", tree


def benchmark_name() -> str:
    """`folder.name` of the benchmark this process runs (`python -m benchmarks.folder.name`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name if spec is not None else ""
    if not module.startswith("benchmarks."):
        raise RuntimeError(f"run benchmarks as `python -m benchmarks.<folder>.<name>`, not as {module or 'a file'}")
    return module.removeprefix("benchmarks.")


@dataclass
class Sitting:
    """The figures of one run of one benchmark, written as one result file.

    `measures` names the packages whose code the figures depend on (the staleness check);
    `part` names the part of a script whose parts run separately (proxies' `refusals`)."""

    measures: Sequence[str]
    part: str | None = None
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    name: str = field(default_factory=benchmark_name)
    command: str = ""
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        # Paths inside the checkout as the checkout names them, so that the command runs in another.
        argv = [arg.replace(f"{ROOT}/", "") for arg in sys.argv[1:]]
        self.command = self.command or shlex.join(["python", "-m", f"benchmarks.{self.name}", *argv])
        unknown = set(self.measures) - set(PACKAGES)
        if unknown or not self.measures:
            raise ValueError(f"measures must name some of {PACKAGES}, not {sorted(unknown) or 'none'}")

    def figure(
        self,
        name: str,
        value: float | None,
        unit: str,
        *,
        baseline: tuple[str, float | None] | None = None,
        ratio: float | None = None,
        difference: float | None = None,
        bar: str | None = None,
        met: bool | None = None,
        headline: bool = True,
        note: str = "",
    ) -> Figure:
        """Record one figure (and return it). With a baseline and neither `ratio` nor `difference`,
        the ratio is value / baseline value."""
        base_name, base_value = baseline if baseline else (None, None)
        if ratio is None and difference is None and value is not None and base_value:
            ratio = value / base_value
        fig = Figure(
            name=name,
            value=value,
            unit=unit,
            baseline=base_name,
            baseline_value=base_value,
            ratio=ratio,
            difference=difference,
            bar=bar,
            met=met,
            headline=headline,
            note=note,
        )
        self.figures.append(fig)
        return fig

    def path(self) -> Path:
        folder, _, script = self.name.partition(".")
        base = Path(os.environ.get(RESULTS_ENV) or RESULTS)
        return base / folder / (f"{script}-{self.part}.json" if self.part else f"{script}.json")

    def record(self) -> dict[str, Any]:
        commit = os.environ.get(COMMIT_ENV)  # a copy of the tree: its commit, clean, as its sender named it
        dirty = "" if commit else git("status", "--porcelain", "--", *self.measures)
        commit = commit or git("rev-parse", "HEAD")
        return {
            "benchmark": self.name,
            "part": self.part,
            "command": self.command,
            "commit": commit,
            "dirty": bool(dirty),
            "measures": list(self.measures),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - self.started, 1),
            "machine": asdict(Machine.here()),
            "figures": [asdict(f) for f in self.figures],
            "details": self.details,
        }

    def write(self) -> Path:
        """Write the result file, say where, and return its path."""
        if not self.figures:
            raise ValueError(f"{self.name}: no figures to write")
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        options = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        path.write_bytes(orjson.dumps(self.record(), option=options) + b"\n")
        print(f"result: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", flush=True)
        return path
