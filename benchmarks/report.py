"""Build the current-figures page, docs/BENCHMARKS.md, from the committed result files.

    python -m benchmarks.report [--results DIR] [--out docs/BENCHMARKS.md] [--methods docs/benchmarks/methods.md]
                                [--images docs/img]
    make bench-report

One table, one row per headline figure of the latest result of each benchmark
(benchmarks/results/<folder>/<name>.json, written by the benchmark itself: harness/results.py):
the figure, this project's value, the baseline measured beside it in the same sitting, their
ratio, the bar it is held to, the machine, the date and the command that re-runs it. A figure with
no baseline is absolute and holds for its machine only; a ratio is what carries across machines.

A figure is marked stale when a commit after its result's touched a package it measures (`git
rev-list RESULT..HEAD -- PACKAGES`), or when it was measured with uncommitted changes to one: the
number may no longer be what that code does. Benchmarks with no result file yet are listed with
their commands. The page is generated whole: edit this script or re-run a benchmark, not the page.

Below the table, pictures (benchmarks/plots.py) drawn from the same result files, never from
benchmarks/out/, into docs/img/bench-*.svg: each with a caption naming its machine, date, command
and staleness, as the table does; a picture whose result lacks a field it needs is not drawn, and
the page says which command keeps it.

It also writes docs/benchmarks/methods.md from the benchmarks' own docstrings (what each does and
why), so the methods cannot drift from the code that runs them.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from benchmarks import plots
from benchmarks.harness.results import RESULTS, ROOT, Machine, git

FOLDERS = {  # the order of the page, and what each kind of measurement is
    "peers": "beside other software, in the same sitting",
    "cost": "the governor's own cost",
    "admission": "does a limit hold what it promises",
    "engine": "the worker's engine",
    "robustness": "hostile input and long runs",
}
PAGE = ROOT / "docs" / "BENCHMARKS.md"
INTRO = """\
One row per benchmark (per part, where its parts run on their own): the first headline figure of
its latest result; every figure of each result is further down. **Beside it** is a baseline
measured in the same sitting, on the same machine (in rounds alternating with this project where
the benchmark says so, in its methods); the **ratio** is
this project's value over it (or, for what the governor adds to a path, the difference), and it is
what carries from one machine to another. A figure with nothing beside it is absolute: it holds
for its machine only (the machines are listed below the table). A result is **stale** when the
code it measures changed after it was taken. What each benchmark does and why:
[methods](benchmarks/methods.md); every earlier sitting, dated, with its full tables:
[sittings](benchmarks/sittings.md). The command in each row re-runs it and rewrites its result
file; `make bench-report` then rebuilds this page."""
METHODS = ROOT / "docs" / "benchmarks" / "methods.md"
IMAGES = ROOT / "docs" / "img"


@dataclass(frozen=True)
class Result:
    path: Path
    record: dict[str, Any]

    @property
    def folder(self) -> str:
        return str(self.record["benchmark"]).partition(".")[0]

    @property
    def machine(self) -> Machine:
        fields = dict(self.record["machine"])
        fields["flags"] = tuple(fields["flags"])
        return Machine(**fields)

    @property
    def date(self) -> str:
        return str(self.record["date"])[:10]


@dataclass(frozen=True)
class Freshness:
    """Whether a result still describes the code at HEAD, and if not, why."""

    stale: bool
    why: str = ""


def load(results: Path) -> list[Result]:
    found = [Result(path, orjson.loads(path.read_bytes())) for path in sorted(results.glob("*/*.json"))]
    return sorted(found, key=lambda r: (list(FOLDERS).index(r.folder) if r.folder in FOLDERS else 99, r.path.name))


def freshness(record: dict[str, Any], repo: Path = ROOT) -> Freshness:
    """Compare the result's commit with the commits since that touched what it measures."""
    commit, measures = record.get("commit"), list(record.get("measures") or [])
    if not commit or git("cat-file", "-e", f"{commit}^{{commit}}", cwd=repo) is None:
        return Freshness(True, "measured at a commit this history does not have")
    later = git("rev-list", f"{commit}..HEAD", "--", *measures, cwd=repo)
    if later is None:
        return Freshness(True, "its commit could not be compared with HEAD")
    if later:
        commits = later.splitlines()
        last = git("log", "-1", "--format=%h %cs", commits[0], cwd=repo) or commits[0][:9]
        paths = ", ".join(f"{m}/" for m in measures)
        return Freshness(True, f"{len(commits)} later commit(s) changed {paths} (the last: {last})")
    if record.get("dirty"):
        return Freshness(True, "measured with uncommitted changes to " + ", ".join(f"{m}/" for m in measures))
    return Freshness(False)


def number(x: float | None) -> str:
    """Short and exact enough: whole numbers as they are, thousands separated from 100 on, three
    significant digits below."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 100 or x == int(x):
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:#.3g}".rstrip(".")  # 1.004 is 1.00, not 1: a whole number is only what is whole


def quantity(x: float | None, unit: str) -> str:
    if x is None:
        return "–"
    if unit == "%":
        return f"{number(x)}%"
    if unit == "x":
        return f"{number(x)}×"
    return f"{number(x)} {unit}".rstrip()


def comparison(fig: dict[str, Any]) -> str:
    """This project against its baseline: a ratio, or what it adds in the figure's unit."""
    if fig.get("ratio") is not None:
        return f"{number(fig['ratio'])}×"
    if fig.get("difference") is not None:
        sign = "+" if fig["difference"] >= 0 else "−"
        return sign + quantity(abs(fig["difference"]), fig["unit"])
    return ""


def bar_cell(fig: dict[str, Any]) -> str:
    bar = fig.get("bar")
    if not bar:
        return ""
    met = fig.get("met")
    return f"{bar}: {'met' if met else 'missed'}" if met is not None else bar


def cells(fig: dict[str, Any]) -> list[str]:
    """A figure's own cells: its name, its value, what it was measured beside, the comparison, the bar."""
    baseline = ""
    if fig.get("baseline"):
        baseline = f"{fig['baseline']}: {quantity(fig.get('baseline_value'), fig['unit'])}"
    return [fig["name"], quantity(fig.get("value"), fig["unit"]), baseline, comparison(fig), bar_cell(fig)]


def row(values: list[str]) -> str:
    return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"


def anchor(result: Result) -> str:
    return str(result.path.relative_to(result.path.parents[1]).with_suffix("")).replace("/", "-").replace("_", "-")


class Page:
    """The page's parts: the one-screen table (the first headline figure of each result), and every
    figure of every result below it, with the machines and the stale results' reasons."""

    def __init__(self, results: list[Result], repo: Path) -> None:
        self.results = results
        self.machines: dict[Machine, str] = {}
        for result in results:
            self.machines.setdefault(result.machine, f"M{len(self.machines) + 1}")
        self.fresh = {r.path: freshness(r.record, repo) for r in results}
        self.stale = [r for r in results if self.fresh[r.path].stale]

    def date(self, result: Result) -> str:
        if not self.fresh[result.path].stale:
            return result.date
        return f"{result.date} **stale**[^{self.stale.index(result) + 1}]"

    def result_of(self, benchmark: str, part: str | None) -> Result | None:
        """The result of one benchmark's run (its default run's: part None), if there is one."""
        return next(
            (r for r in self.results if (r.record["benchmark"], r.record.get("part")) == (benchmark, part)), None
        )

    def summary(self) -> list[str]:
        lines = []
        for folder, what in FOLDERS.items():
            mine = [r for r in self.results if r.folder == folder]
            if mine:
                lines.append(f"| **{folder}/** — {what} | | | | | | | |")
            for result in mine:
                first = next((f for f in result.record["figures"] if f.get("headline", True)), None)
                if first is None:
                    continue
                name = cells(first)
                name[0] = f"[{name[0]}](#{anchor(result)})"
                command = f"`{result.record['command']}`"
                lines.append(row([*name, self.machines[result.machine], self.date(result), command]))
        return lines

    def every_figure(self) -> list[str]:
        lines = []
        for result in self.results:
            r = result.record
            title = f"{r['benchmark'].replace('.', '/')}" + (f" ({r['part']})" if r.get("part") else "")
            commit = (r.get("commit") or "unknown")[:9]
            lines += [
                "",
                f'<a id="{anchor(result)}"></a>',
                f"### {title}",
                "",
                f"`{r['command']}` · {self.machines[result.machine]} · {self.date(result)} · commit {commit} · "
                f"{r['wall_s']:,.0f} s",
                "",
                "| figure | value | beside it | ratio or difference | bar | note |",
                "|---|---|---|---|---|---|",
                *(row([*cells(f), f.get("note", "")]) for f in r["figures"]),
            ]
        return lines


def benchmark_modules() -> dict[str, list[str]]:
    """Every benchmark script, by folder: the modules of each folder but its package file."""
    return {
        folder: sorted(p.stem for p in (ROOT / "benchmarks" / folder).glob("*.py") if p.stem != "__init__")
        for folder in FOLDERS
    }


def page(results: list[Result], repo: Path = ROOT) -> str:
    return render(Page(results, repo))


def pictures(built: Page, images: Path, page_dir: Path) -> list[str]:
    """Draw every picture its result allows into `images` (rewriting a file only when its bytes
    change), and return the page's lines for them: each image with its caption, or why it is not
    drawn and which command keeps what it needs. A picture not drawn loses its old file: the page
    never shows a picture of a result it no longer has."""
    lines: list[str] = []
    for picture in plots.PICTURES:
        path = images / f"{picture.name}.svg"
        result = built.result_of(picture.benchmark, picture.part)
        try:
            if result is None:
                raise plots.Missing("")
            image = plots.svg(picture, result.record)
        except plots.Missing as missing:
            path.unlink(missing_ok=True)
            if result is None:
                why = f"no result yet; `{picture.command}` produces it"
            else:
                where = result.path.relative_to(result.path.parents[1])
                why = f"`{where}` has no `{missing}`; `{result.record['command']}` (re-run) keeps it"
            lines += [f"- **{picture.title}**: not drawn: {why}.", ""]
            continue
        images.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != image:
            path.write_bytes(image)
        machine = result.machine
        lines += [
            f"![{picture.title}]({Path(os.path.relpath(path, page_dir)).as_posix()})",
            "",
            f"**{picture.title}.** {machine.cpu} ({' '.join(machine.flags) or 'no vector flags'}), "
            f"{machine.cores} cores ({built.machines[machine]}) · {built.date(result)} · "
            f"`{result.record['command']}` · [every figure](#{anchor(result)})",
            "",
        ]
    return lines


def render(built: Page, drawn: Sequence[str] = ()) -> str:
    results = built.results
    measured = {str(r.record["benchmark"]) for r in results}
    missing = [
        f"`python -m benchmarks.{folder}.{name}`"
        for folder, names in benchmark_modules().items()
        for name in names
        if f"{folder}.{name}" not in measured
    ]
    out = [
        "# Benchmarks: the current figures",
        "",
        "<!-- Generated by `make bench-report` (benchmarks/report.py) from benchmarks/results/. Do not edit:",
        "     re-run a benchmark (it rewrites its result file), then the report. -->",
        "",
        *INTRO.splitlines(),
        "",
        "| figure | this project | beside it (same sitting) | ratio or difference | bar | machine | date | command |",
        "|---|---|---|---|---|---|---|---|",
        *built.summary(),
        "",
        "Machines:",
        "",
        *[f"- **{label}**: {machine.line()}, {machine.memory_gib:g} GiB" for machine, label in built.machines.items()],
    ]
    if built.stale:
        out += [""]
        out += [
            f"[^{i}]: `{r.path.relative_to(r.path.parents[1])}`: {built.fresh[r.path].why}."
            for i, r in enumerate(built.stale, 1)
        ]
    if missing:
        out += [
            "",
            "Not measured since results were kept as files (their last figures, dated, are in the",
            "[sittings](benchmarks/sittings.md)): " + ", ".join(missing) + ".",
        ]
    if drawn:
        out += [
            "",
            "## Pictures",
            "",
            "Drawn by `make bench-report` from the result files above (benchmarks/plots.py), not from",
            "per-request samples; each names the machine, the date and the command of its result.",
            "",
            *drawn,
        ]
    out += [
        "",
        "## Every figure, by benchmark",
        "",
        "Each result file's figures, headline or not, with its notes.",
        *built.every_figure(),
    ]
    return "\n".join(out) + "\n"


def docstring(folder: str, name: str | None = None) -> str:
    """A module's docstring, read from its source (importing a benchmark would import torch)."""
    path = ROOT / "benchmarks" / folder / (f"{name}.py" if name else "__init__.py")
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def methods() -> str:
    out = [
        "# Benchmarks: methods",
        "",
        "<!-- Generated by `make bench-report` (benchmarks/report.py) from the benchmarks' docstrings. -->",
        "",
        "What each benchmark does and why, as its own docstring says (`python -m benchmarks.<folder>.<name>",
        "--help` prints the same with its options). The figures are on the [current-figures page](../BENCHMARKS.md);",
        "the definitions of the figures `governor bench` reports (TTFT, TPOT, ITL, goodput, ...) are in",
        "`governor/bench/stats.py` and in [the sittings](sittings.md#definitions).",
    ]
    for folder in FOLDERS:
        out += ["", f"## {folder}/", "", docstring(folder)]
        for name in benchmark_modules()[folder]:
            text = docstring(folder, name)
            out += ["", f"### `{folder}/{name}.py`", "", text] if text else []
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument("--methods", type=Path, default=METHODS)
    parser.add_argument("--images", type=Path, default=IMAGES, help="where the pictures go")
    args = parser.parse_args()
    built = Page(load(args.results), ROOT)
    args.out.write_text(render(built, pictures(built, args.images, args.out.parent)))
    args.methods.parent.mkdir(parents=True, exist_ok=True)
    args.methods.write_text(methods())
    print(f"{args.out}: {len(built.results)} results, {len(built.stale)} stale; {args.methods}")


if __name__ == "__main__":
    main()
