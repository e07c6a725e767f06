"""The figures page's pictures, each drawn from one result file alone.

A picture is a function of one result record (benchmarks/results/<folder>/<name>.json), never of
benchmarks/out/: the per-request samples there are not committed, so a picture drawn from them
could not be redrawn from the repository, nor checked against the numbers on the page. A record
that lacks a field a picture needs raises `Missing`, naming the field; the page then says which
command keeps it, and nothing is drawn in its place.

Every picture carries its machine (CPU model and vector flags), date, commit and command in a
footer, because an absolute number holds for its machine only and an image travels without its
page (the README shows one). The SVG is deterministic (its ids salted with a fixed string, no
date, text kept as text), so an unchanged result redraws byte for byte and `make bench-report`
leaves the tree clean. It uses matplotlib's object API, not pyplot: no backend, no global figure
registry, nothing to close when a picture is abandoned half-way.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType  # matplotlib >= 3.9's stubs

# What makes the SVG the same bytes for the same record: the ids matplotlib derives from
# `svg.hashsalt` (a random salt otherwise), and text written as <text> rather than glyph paths (a
# tenth of the size, and a diff of two pictures shows which labels changed).
RC: dict[RcKeyType, Any] = {
    "svg.hashsalt": "governor-benchmarks",
    "svg.fonttype": "none",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
GOVERNOR, BASELINE = "C0", "C1"  # one colour for the governor's side of every picture, one for what it is beside
Record = Mapping[str, Any]


class Missing(Exception):
    """A result lacks a field a picture needs; the message names it (`details.points`)."""


@dataclass(frozen=True)
class Picture:
    """One picture of the page: the file it is written to, the result it is drawn from, what it shows."""

    name: str  # the file's stem under docs/img/
    benchmark: str  # the result's `benchmark` ("admission.load_sweep")
    part: str | None  # and its `part` (None: the default run's file)
    command: str  # what produces that result, for a page that has none yet
    title: str  # what it shows, in words: the caption and the image's alt text
    draw: Callable[[Record], Figure]  # raises Missing before it draws anything


def need(record: Any, *path: str | int) -> Any:
    """`record[path[0]][path[1]]...`, or Missing naming the first step that is not there (or None)."""
    here = record
    for i, step in enumerate(path):
        if isinstance(here, Mapping) and step in here:
            here = here[step]
        elif isinstance(here, list) and isinstance(step, int) and -len(here) <= step < len(here):
            here = here[step]
        else:
            here = None
        if here is None:
            raise Missing(dotted(path[: i + 1]))
    return here


def dotted(path: Sequence[str | int]) -> str:
    return ".".join(str(step) for step in path)


def number(record: Any, *path: str | int) -> float:
    """The number at `path`: Missing if it is absent or not a number (a run that kept no value is
    not a zero)."""
    value = need(record, *path)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Missing(f"{dotted(path)} (a number)")
    return float(value)


def items(record: Any, *path: str | int) -> range:
    """The indices of the non-empty list at `path`."""
    found = need(record, *path)
    if not isinstance(found, list) or not found:
        raise Missing(f"{dotted(path)} (a list)")
    return range(len(found))


def column(record: Any, *path: str | int, key: str | None = None) -> list[float]:
    """The numbers of the list at `path` (with `key`: each item's `key`)."""
    return [number(record, *path, i, *(() if key is None else (key,))) for i in items(record, *path)]


def footer(record: Record) -> str:
    """The picture's provenance, as the page's caption gives it: machine, date, commit, command."""
    flags = " ".join(need(record, "machine", "flags")) or "no vector flags"
    commit = str(record.get("commit") or "unknown")[:9]
    return (
        f"{need(record, 'machine', 'cpu')} ({flags}), {need(record, 'machine', 'cores')} cores\n"
        f"{str(need(record, 'date'))[:10]} · commit {commit} · {need(record, 'command')}"
    )


def figure(record: Record, columns: int, title: str) -> tuple[Figure, list[Axes]]:
    """A figure of `columns` panels side by side, its title above and its footer below."""
    fig = Figure(figsize=(5.2 * columns, 4.2))
    axes = [fig.add_subplot(1, columns, i + 1) for i in range(columns)]
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, footer(record), fontsize=6.5, color="0.4")
    return fig, axes


def svg(picture: Picture, record: Record) -> bytes:
    """The picture of `record` as SVG bytes: the same bytes for the same record (Missing if it lacks
    a field the picture needs)."""
    with matplotlib.rc_context(RC):
        fig = picture.draw(record)
        fig.tight_layout(rect=(0, 0.07, 1, 1))  # the footer's two lines below
        out = io.BytesIO()
        fig.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()


def load_sweep(record: Record) -> Figure:
    """Goodput and TTFT p99 against offered load, the capped governor beside the unlimited one."""
    points = need(record, "details", "points")
    capped = next((name for name in points if name.startswith("--max-inflight")), None)
    if capped is None or "unlimited" not in points:
        raise Missing("details.points: a '--max-inflight N' series and an 'unlimited' one")
    capacity = number(record, "details", "capacity_rps")
    slo = number(record, "details", "slo_ttft_ms")
    series = {
        name: [
            column(record, "details", "points", name, key=key) for key in ("offered_rps", "goodput_rps", "ttft_p99_ms")
        ]
        for name in (capped, "unlimited")
    }
    title = "open-loop load at a GPT-2 worker, through a governor with and without its cap"
    fig, (left, right) = figure(record, 2, title)
    top = max(max(s[0]) for s in series.values())
    left.plot([0, top], [0, top], ls="--", color="0.6", lw=1, label="offered")
    for ax in (left, right):
        ax.axvline(capacity, ls=":", color="0.4", lw=1, label=f"capacity, closed loop ({capacity:.1f} req/s)")
    right.axhline(slo, ls="--", color="0.6", lw=1, label=f"TTFT SLO ({slo:g} ms)")
    for name, colour in ((capped, GOVERNOR), ("unlimited", BASELINE)):
        offered, goodput, p99 = series[name]
        label = f"governor {name}" if name == capped else "governor, no cap (unlimited)"
        left.plot(offered, goodput, marker="o", color=colour, label=label)
        right.plot(offered, p99, marker="o", color=colour, label=label)
    left.set(xlabel="offered load (req/s)", ylabel="goodput (req/s)", title=f"goodput: requests with TTFT ≤ {slo:g} ms")
    right.set(xlabel="offered load (req/s)", ylabel="ms", yscale="log", title="TTFT p99 of completed requests")
    left.legend(fontsize="small")
    right.legend(fontsize="small")
    return fig


def sdk_overload(record: Record) -> Figure:
    """The openai SDK at its defaults straight at llama-server and through the governor, each
    load: goodput per round (and its median), and what became of every request sent."""
    rounds = items(record, "details", "rounds")
    capacity = number(record, "details", "capacity_per_s")
    loads = list(need(record, "details", "rounds", 0))
    keys = ("goodput_per_s", "sent", "completed", "within_slo")
    runs = {
        (load, side): {key: [number(record, "details", "rounds", r, load, side, key) for r in rounds] for key in keys}
        for load in loads
        for side in ("direct", "governor")
    }
    slo = record["details"].get("slo_ms")
    fig, (left, right) = figure(record, 2, f"openai SDK (max_retries=2) against llama-server, {len(rounds)} rounds")
    names = [label(load, runs[load, "direct"]["sent"], record) for load in loads]
    width = 0.38
    for k, (side, colour, text) in enumerate(
        (("direct", BASELINE, "straight to llama-server"), ("governor", GOVERNOR, "through the governor"))
    ):
        xs = [i + (k - 0.5) * width for i in range(len(loads))]
        goodput = [runs[load, side]["goodput_per_s"] for load in loads]
        left.bar(xs, [statistics.median(g) for g in goodput], width, color=colour, alpha=0.8, label=f"{text}, median")
        for x, values in zip(xs, goodput, strict=True):
            left.plot([x] * len(values), values, "o", color="black", ms=3, zorder=3)
        done = [sum(runs[load, side]["completed"]) for load in loads]
        within = [sum(runs[load, side]["within_slo"]) for load in loads]
        sent = [sum(runs[load, side]["sent"]) for load in loads]
        late = [d - w for d, w in zip(done, within, strict=True)]
        failed = [s - d for s, d in zip(sent, done, strict=True)]
        right.bar(xs, within, width, color=colour, label=f"{text}: within the SLO")
        right.bar(xs, late, width, bottom=within, color=colour, alpha=0.35, label=f"{text}: completed late")
        bottom = [w + la for w, la in zip(within, late, strict=True)]
        failures = f"{text}: failed (the SDK raised)"
        right.bar(xs, failed, width, bottom=bottom, color="none", edgecolor=colour, hatch="//", label=failures)
    left.axhline(capacity, ls=":", color="0.4", lw=1, label=f"capacity, closed loop ({capacity:.2f} req/s)")
    slo_text = f"TTFT ≤ {slo:g} ms" if isinstance(slo, int | float) else "TTFT within the SLO"
    top = max(capacity, *(v for run in runs.values() for v in run["goodput_per_s"]))
    left.set(ylabel="goodput (req/s)", title=f"goodput ({slo_text}); dots: each round", ylim=(0, 1.4 * top))
    right.set(ylabel="requests, summed over rounds", title="every request sent: what became of it")
    for ax in (left, right):
        ax.set_xticks(range(len(loads)), names)
        ax.legend(fontsize="small", loc="upper left")
    return fig


def label(load: str, sent: Sequence[float], record: Record) -> str:
    """A load's name with its size: a burst's requests, a Poisson load's rate."""
    if load == "poisson" and isinstance(rate := record["details"].get("poisson_rate_per_s"), int | float):
        return f"Poisson\n{rate:.1f} req/s"
    if load.startswith("burst") and len(set(sent)) == 1:
        return f"{load}\n{sent[0]:g} at once"
    return load


def llamacpp(record: Record) -> Figure:
    """Served tokens/s, the governor and its GPT-2 worker beside llama-server, per dtype and
    workload: medians over rounds, the figure's ratio, and the range of the rounds' own ratios
    where the details keep them."""
    prefix = "served tok/s, "
    cases = [
        f
        for f in need(record, "figures")
        if str(f.get("name", "")).startswith(prefix) and f.get("baseline") == "llama-server"
    ]
    if not cases or not all(isinstance(f.get(k), int | float) for f in cases for k in ("value", "baseline_value")):
        raise Missing("figures 'served tok/s, …' with llama-server's value beside them")
    details = record.get("details") or {}
    fig, (ax,) = figure(record, 1, "GPT-2 small (random weights) served over /v1/completions, same threads")
    fig.set_size_inches(max(6.0, 1.8 * len(cases)), 4.4)
    width = 0.38
    xs = range(len(cases))
    theirs = [f["baseline_value"] for f in cases]
    ax.bar([x - width / 2 for x in xs], theirs, width, color=BASELINE, label="llama-server")
    ours = [f["value"] for f in cases]
    ax.bar([x + width / 2 for x in xs], ours, width, color=GOVERNOR, label="governor + its GPT-2 worker")
    for x, f in zip(xs, cases, strict=True):
        by_round = (details.get(f["name"].removeprefix(prefix)) or {}).get("paired_by_round") or []
        spread = f"\n({min(by_round):.2f}–{max(by_round):.2f})" if len(by_round) > 1 else ""
        ratio = f["ratio"] if isinstance(f.get("ratio"), int | float) else f["value"] / f["baseline_value"]
        ax.annotate(f"{ratio:.2f}×{spread}", (x + width / 2, f["value"]), ha="center", va="bottom", fontsize=8)
    names = [f["name"].removeprefix(prefix).replace(" workload", "").replace(", ", "\n") for f in cases]
    ax.set_xticks(list(xs), names)
    ax.margins(y=0.18)
    ax.set(ylabel="completion tok/s (median over rounds)", title="served tok/s; above: the ratio (its rounds' range)")
    ax.legend(fontsize="small", loc="upper right")
    return fig


def burst(record: Record) -> Figure:
    """TTFT distribution of a burst's admitted requests, without a cap and with `--max-inflight`:
    one line per repeat, from the quantiles the result keeps."""
    pairs = items(record, "details", "pairs")
    first = need(record, "details", "pairs", 0)
    capped = next((name for name in first if name.startswith("--max-inflight")), None)
    if capped is None or "unlimited" not in first:
        raise Missing("details.pairs.0: a '--max-inflight N' run and an 'unlimited' one")
    curves = {
        name: [column(record, "details", "pairs", i, name, "ttft_quantiles_ms") for i in pairs]
        for name in ("unlimited", capped)
    }
    served = {name: counts(record, pairs, name, "accepted") for name in curves}
    yielded = {name: counts(record, pairs, name, "yielded") for name in curves}
    size = counts(record, pairs, "unlimited", "accepted", "yielded")
    fig, (ax,) = figure(record, 1, f"a burst of {size} prefill-heavy requests at a GPT-2 worker, {len(pairs)} repeats")
    fig.set_size_inches(7.5, 4.6)
    for name, colour in (("unlimited", BASELINE), (capped, GOVERNOR)):
        run = "no cap (unlimited)" if name == "unlimited" else name
        text = f"{run}: {served[name]} served, {yielded[name]} yielded at once"
        for i, quantiles in enumerate(curves[name]):
            qs = [100 * k / (len(quantiles) - 1) for k in range(len(quantiles))]
            ax.plot(quantiles, qs, color=colour, lw=1.2, alpha=0.8, label=text if i == 0 else None)
    ax.set(xlabel="TTFT of served requests (ms)", ylabel="percentile", title="TTFT distribution, one line per repeat")
    ax.set_yticks([0, 25, 50, 75, 90, 99])
    ax.legend(fontsize="small", loc="lower right")
    return fig


def hint_policies(record: Record) -> Figure:
    """Each retry-hint policy per load: the share of the requests sent served within the SLO
    (medians over rounds, a dot per round), at the default horizon's SLO and at the long
    horizon's. Every policy is sent the same requests in a round, so the shares compare."""
    rounds = items(record, "details", "rounds")
    loads = list(need(record, "details", "rounds", 0))
    names = list(need(record, "details", "rounds", 0, loads[0]))
    slo_s = number(record, "details", "slo_ms") / 1000
    horizon_s = number(record, "details", "horizon_ms") / 1000
    title = f"openai SDK (max_retries=2) against llama-server, each hint policy, {len(rounds)} rounds"
    fig, axes = figure(record, 2, title)
    fig.set_size_inches(12.0, 4.6)
    width = 0.8 / len(names)

    def served(r: int, load: str, name: str, key: str) -> float:
        return (
            100
            * number(record, "details", "rounds", r, load, name, key)
            / number(record, "details", "rounds", r, load, name, "sent")
        )

    for ax, key, slo in zip(axes, ("within_slo", "within_horizon"), (slo_s, horizon_s), strict=True):
        for k, name in enumerate(names):
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(loads))]
            values = [[served(r, load, name, key) for r in rounds] for load in loads]
            colour = GOVERNOR if name == "ours" else BASELINE if name == "server alone" else f"C{k + 1}"
            ax.bar(xs, [statistics.median(v) for v in values], width, color=colour, alpha=0.85, label=name)
            for x, v in zip(xs, values, strict=True):
                ax.plot([x] * len(v), v, "o", color="black", ms=2, zorder=3)
        sent = [number(record, "details", "rounds", 0, load, names[0], "sent") for load in loads]
        ax.set_xticks(range(len(loads)), [label(load, [n], record) for load, n in zip(loads, sent, strict=True)])
        ax.set(ylabel="% of requests sent", ylim=(0, 110), title=f"served with TTFT ≤ {slo:g} s from the first attempt")
    axes[0].legend(fontsize="x-small", loc="upper right", ncols=2)
    return fig


def counts(record: Record, pairs: range, name: str, *keys: str) -> str:
    """A run's count (the sum of `keys`) over the repeats: one number where they agree, else their range."""
    found = sorted({sum(int(number(record, "details", "pairs", i, name, key)) for key in keys) for i in pairs})
    return str(found[0]) if len(found) == 1 else f"{found[0]}–{found[-1]}"


PICTURES = (
    Picture(
        "bench-load-sweep",
        "admission.load_sweep",
        None,
        "python -m benchmarks.admission.load_sweep",
        "Goodput and TTFT p99 against offered load, with and without the governor's cap",
        load_sweep,
    ),
    Picture(
        "bench-sdk-overload",
        "peers.sdk_overload",
        None,
        "python -m benchmarks.peers.sdk_overload --rounds 3",
        "The openai SDK against llama-server, straight and through the governor: goodput and every request's fate",
        sdk_overload,
    ),
    Picture(
        "bench-llamacpp",
        "peers.llamacpp",
        None,
        "python -m benchmarks.peers.llamacpp --dtypes bfloat16,float32 --workloads uniform,mixed --rounds 3",
        "Served tok/s beside llama-server, per dtype and workload",
        llamacpp,
    ),
    Picture(
        "bench-burst",
        "admission.burst",
        None,
        "python -m benchmarks.admission.burst --repeats 3",
        "TTFT distribution under a burst, with and without the cap",
        burst,
    ),
    Picture(
        "bench-hint-policies",
        "peers.hint_policies",
        None,
        "python -m benchmarks.peers.hint_policies --rounds 3",
        "Goodput of the governor's retry hint beside rival rules (constant 1 s, llm-d's, none, refusing at once)",
        hint_policies,
    ),
)
