"""Experiment 9: admission by who — tenants' fair shares and priority classes, through the governor.

    python -m benchmarks.admission.tenants [--experiments neighbour,weights,classes] [--seconds 20]

One standalone GPT-2 worker (`worker serve`, random weights: a prompt of n ASCII characters is n
tokens) serves every run; each configuration is a `governor serve --worker` in front of it
(`--max-inflight 8`, `--tenant-from frame`), started in turn. Requests are greedy with 16 new
tokens, end-of-sequence ignored. Arrivals are Poisson and seeded, so configurations compared side
by side see the same arrivals. TTFT counts from a request's first submission, retries included, as
its user sees it.

- capacity:  short prompts (32 tokens) in a closed loop of 8 clients: completed requests/s (C).
- neighbour: tenant B offers 0.3 C; tenant A floods at 5 C. Both retry a yield after its hint
             (until the run ends), sending its ticket back. B alone; A and B with no tenants configured (one anonymous
             population); A and B as tenants of weight 1 each; the same with B's
             guaranteed_inflight (`--guarantee`, 4 by default). B's goodput (completed/s) and TTFT
             p99 against B alone, A's completed/s. Bars: goodput >= 95%, TTFT p99 <= 2x by
             default, <= 1.5x with the guarantee. B sends about 90 requests in 20 s: its "p99"
             (harness/experiment.ttft_ms, the value at index int(0.99 n)) is then their maximum.
- weights:   two backlogged tenants (16 closed-loop clients each, retrying), weights 3:1, A's
             prompts 32 tokens and B's 128: the token cost each was served (the governor's
             per-tenant settled tokens). Bar: A:B within 10% of 3:1.
- classes:   open loop at 1.5 C, a third of the arrivals each critical, standard, sheddable, a yield
             final but a `preempted` one (admitted, then displaced: not kept, and retried at its
             hint with its ticket, as an SDK retries a 429); the
             same arrivals with no class; with `--class-flags`, more runs with those flags (e.g.
             '--preempt off'). Per class the share of what it offered that was admitted and kept;
             completed requests/s against the classless run. Bars: critical >= 99% admitted,
             sheddable takes most yields, throughput >= 0.95x.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from benchmarks.harness.common import fmt, machine, markdown_table, random_text, stats, stop
from benchmarks.harness.experiment import (
    MAX_NEW,
    Arrival,
    Outcome,
    Run,
    WorkerBench,
    finish,
    poisson,
    ttft_ms,
    worker_options,
)
from benchmarks.harness.results import Sitting
from governor.client import NO_RETRY, AsyncClient, Yielded

SHORT, LONG = 32, 128
MAX_INFLIGHT = 8
EXPERIMENTS = ("neighbour", "weights", "classes")


def p99_ms(outcomes: list[Outcome]) -> float | None:
    return ttft_ms(outcomes, 0.99)


class Bench(WorkerBench):
    """Every governor at `--max-inflight 8`, tenants named by the frame."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__("tenants", args, "--max-inflight", str(MAX_INFLIGHT), "--tenant-from", "frame")

    def retrying(self, name: str, flags: list[str], plan: list[Arrival]) -> Run:
        """Every yield retried at its hint until the arrivals end."""
        return self.run(name, flags, plan, retry_for_s=self.args.seconds, victims_retry_for_s=self.args.seconds)

    def final(self, name: str, flags: list[str], plan: list[Arrival]) -> Run:
        """A yield final, but a `preempted` one retried at its hint until the arrivals end."""
        return self.run(name, flags, plan, victims_retry_for_s=self.args.seconds)


def record_neighbour(sitting: Sitting, measured: dict[str, dict[str, float | None]], guarantee: int) -> None:
    """B beside A's flood against B alone. The bars (this script's docstring): B keeps >= 95% of its
    solo goodput with tenants; its TTFT p99 at most 2x its solo p99, 1.5x with the guarantee."""
    solo = measured["B alone"]

    def add(label: str, run: str, key: str, unit: str, bar: tuple[str, float] | None, headline: bool) -> None:
        value, base = measured[run][key], solo[key]
        ratio = value / base if value is not None and base else None
        met = None
        if bar is not None and ratio is not None:
            met = ratio <= bar[1] if bar[0] == "<=" else ratio >= bar[1]
        sitting.figure(
            f"{label}, A at 5 C, {run.removeprefix('A + B, ')}", value, unit, baseline=("B alone", base),
            bar=None if bar is None else f"ratio {bar[0]} {bar[1]:g}", met=met, headline=headline,
        )  # fmt: skip

    tenants, kept = "A + B, tenants 1:1", (">=", 0.95)
    runs = {  # run: the bars of B's completed/s and TTFT p99, and whether each is a headline
        tenants: (kept, ("<=", 2.0), True, True),  # first: the page's row for this part
        "A + B, no tenants": (None, None, True, False),
        f"{tenants}, --tenant-share-from 0.5": (kept, ("<=", 2.0), False, False),
    }
    if guarantee:
        runs[f"{tenants}, B guaranteed_inflight={guarantee}"] = (kept, ("<=", 1.5), False, True)
    for run, (rate_bar, p99_bar, rate_headline, p99_headline) in runs.items():
        add("B completed/s", run, "b_completed_rps", "req/s", rate_bar, rate_headline)
        add("B TTFT p99", run, "b_ttft_p99_ms", "ms", p99_bar, p99_headline)
    sitting.figure(
        "A completed/s, A at 5 C, tenants 1:1", measured[tenants]["a_completed_rps"], "req/s", headline=False
    )


def neighbour_experiment(bench: Bench, capacity: float, sitting: Sitting) -> str:
    seconds = bench.args.seconds
    rng = random.Random(11)
    b_plan = [Arrival(t, random_text(rng, SHORT), tenant="B") for t in poisson(0.3 * capacity, seconds, rng)]
    a_plan = [Arrival(t, random_text(rng, SHORT), tenant="A") for t in poisson(5.0 * capacity, seconds, rng)]
    both = sorted(a_plan + b_plan, key=lambda a: a.at)
    tenants = ["--tenant", "A", "--tenant", "B"]
    runs = {
        "B alone": bench.retrying("neighbour_solo", tenants, b_plan),
        "A + B, no tenants": bench.retrying("neighbour_anonymous", [], both),
        "A + B, tenants 1:1": bench.retrying("neighbour_tenants", tenants, both),
        "A + B, tenants 1:1, --tenant-share-from 0.5": bench.retrying(
            "neighbour_tenants_05", [*tenants, "--tenant-share-from", "0.5"], both
        ),
    }
    guarantee = bench.args.guarantee
    if guarantee:
        flags = ["--tenant", "A", "--tenant", f"B,guaranteed_inflight={guarantee}"]
        runs[f"A + B, tenants 1:1, B guaranteed_inflight={guarantee}"] = bench.retrying(
            "neighbour_guaranteed", flags, both
        )
    solo_b = runs["B alone"].of(tenant="B")
    solo_rate = sum(o.status == "done" for o in solo_b) / runs["B alone"].wall_s
    solo_p99 = p99_ms(solo_b)
    rows = []
    measured: dict[str, dict[str, float | None]] = {}
    for name, run in runs.items():
        b, a, wall = run.of(tenant="B"), run.of(tenant="A"), run.wall_s
        rate = sum(o.status == "done" for o in b) / wall
        p99 = p99_ms(b)
        measured[name] = {
            "b_completed_rps": rate,
            "b_ttft_p99_ms": p99,
            "b_retries_per_request": sum(o.attempts - 1 for o in b) / max(1, len(b)),
            "a_completed_rps": sum(o.status == "done" for o in a) / wall if a else None,
        }
        rows.append(
            [
                name,
                f"{rate:.2f} ({rate / solo_rate:.0%})",
                f"{fmt(p99)} ({(p99 or 0) / (solo_p99 or 1):.2f}x)",
                f"{sum(o.attempts - 1 for o in b) / max(1, len(b)):.2f}",
                f"{sum(o.status == 'done' for o in a) / wall:.2f}" if a else "-",
            ]
        )
    table = markdown_table(
        ["run", "B completed/s (vs alone)", "B TTFT p99 ms (vs alone)", "B retries per request", "A completed/s"], rows
    )
    record_neighbour(sitting, measured, guarantee)
    sitting.details = {"capacity_rps": capacity, "runs": measured}
    return (
        f"capacity C = {capacity:.2f} req/s; B offers 0.3 C = {0.3 * capacity:.2f}/s, A 5 C = {5 * capacity:.2f}/s, "
        f"{seconds:g} s of arrivals, both retrying yields.\n\n{table}\n"
    )


def weights_experiment(bench: Bench, sitting: Sitting) -> str:
    seconds = bench.args.seconds
    flags = ["--tenant", "A,weight=3", "--tenant", "B,weight=1"]
    proc, port = bench.governor("weights", *flags)

    async def backlogged() -> None:
        rng = random.Random(3)
        async with AsyncClient(port=port, timeout=None, retry=NO_RETRY) as client:
            await client.connect()
            end = time.perf_counter() + seconds

            async def loop(tenant: str, n: int) -> None:
                while time.perf_counter() < end:
                    try:
                        await client.generate(
                            random_text(rng, n),
                            max_new_tokens=MAX_NEW,
                            tenant=tenant,
                            temperature=0.0,
                            stop_on_eos=False,
                        )
                    except Yielded as exc:
                        await asyncio.sleep(exc.retry_hint_ms / 1000 * random.uniform(1.0, 1.2))

            await asyncio.gather(*(loop("A", SHORT) for _ in range(16)), *(loop("B", LONG) for _ in range(16)))

    try:
        asyncio.run(backlogged())
        snapshot = stats(port)
    finally:
        stop(proc)
    time.sleep(1.0)
    tenants = {t["name"]: t for t in snapshot["tenants"]}
    a, b = tenants["A"], tenants["B"]
    ratio = a["tokens_settled_total"] / max(1, b["tokens_settled_total"])
    rows = [
        [
            name,
            f"{t['weight']:g}",
            str(t["executed_total"]),
            f"{t['tokens_settled_total']:,}",
            f"{t['yielded_by_reason']}",
        ]
        for name, t in (("A (32-token prompts)", a), ("B (128-token prompts)", b))
    ]
    table = markdown_table(["tenant", "weight", "completed", "tokens served", "yields by reason"], rows)
    print(f"  weights: A:B tokens {ratio:.2f}", flush=True)
    off = abs(ratio / 3 - 1)
    sitting.figure("A:B tokens served, weights 3:1", ratio, "x", bar="within 10% of 3", met=off <= 0.1)
    for name, t in (("A", a), ("B", b)):
        sitting.figure(
            f"tokens served to {name}, weight {t['weight']:g}", t["tokens_settled_total"], "tokens", headline=False
        )
    sitting.details = {
        name: {key: t[key] for key in ("weight", "executed_total", "tokens_settled_total", "yielded_by_reason")}
        for name, t in (("A", a), ("B", b))
    }
    return (
        f"{seconds:g} s, 16 closed-loop clients per tenant, retrying.\n\n{table}\n\n"
        f"A:B token ratio {ratio:.2f} (3:1 target, {off:.1%} off)\n"
    )


def record_classes(sitting: Sitting, measured: dict[str, dict[str, Any]], rate_without: float) -> None:
    """Per classes run (the default one's are the headlines), against the classless run. The bars
    (this script's docstring): critical >= 99% admitted, sheddable takes the most yields,
    throughput >= 0.95x."""
    for name, run in measured.items():
        label = "" if name == "classes" else f", {name.removeprefix('classes ')}"
        headline = not label
        by_class = run["classes"]
        critical = by_class["critical"]["admitted_share"]
        sitting.figure(
            f"critical admitted at 1.5 C{label}", 100 * critical, "%", bar=">= 99%", met=critical >= 0.99,
            headline=headline,
        )  # fmt: skip
        sheddable = by_class["sheddable"]["share_of_yields"]
        sitting.figure(
            f"sheddable's share of all yields at 1.5 C{label}", 100 * sheddable, "%", bar="the largest of the classes",
            met=all(sheddable >= c["share_of_yields"] for c in by_class.values()), headline=headline,
        )  # fmt: skip
        ratio = run["completed_rps"] / rate_without
        sitting.figure(
            f"completed/s with classes at 1.5 C{label}", run["completed_rps"], "req/s",
            baseline=("no classes", rate_without), bar="ratio >= 0.95", met=ratio >= 0.95, headline=headline,
        )  # fmt: skip
        for cls in ("standard", "sheddable"):
            sitting.figure(
                f"{cls} admitted at 1.5 C{label}", 100 * by_class[cls]["admitted_share"], "%", headline=False
            )
        sitting.figure(f"displaced (preempted) at 1.5 C{label}", run["preempted"], "requests", headline=False)


def classes_experiment(bench: Bench, capacity: float, sitting: Sitting) -> str:
    seconds = bench.args.seconds
    rng = random.Random(17)
    classes = ("critical", "standard", "sheddable")
    plan = [
        Arrival(t, priority=rng.choice(classes), prompt=random_text(rng, SHORT))  # drawn in this order
        for t in poisson(1.5 * capacity, seconds, rng)
    ]
    classless = [Arrival(a.at, a.prompt) for a in plan]
    variants = {"classes": []} | {f"classes {' '.join(flags)}": flags for flags in bench.args.class_flags}
    runs = {name: bench.final(name.replace(" ", "_"), flags, plan) for name, flags in variants.items()}
    classless_run = bench.final("classless", [], classless)
    without = classless_run.outcomes
    rate_without = classless_run.rps
    rows = []
    measured: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        outcomes, wall = run.outcomes, run.wall_s
        yields_total = sum(o.status == "yield" for o in outcomes)
        preempted = sum("preempted" in o.reasons for o in outcomes)
        by_class: dict[str, dict[str, float | None]] = {}
        for cls in classes:
            mine = run.of(priority=cls)
            admitted = sum(o.status != "yield" and "preempted" not in o.reasons for o in mine)
            completed_after = sum(o.status == "done" and "preempted" in o.reasons for o in mine)
            retried = f" (+{completed_after} on retry)" if completed_after else ""
            yields = sum(o.status == "yield" for o in mine)
            by_class[cls] = {
                "offered": len(mine),
                "admitted_share": admitted / max(1, len(mine)),
                "completed_on_retry": completed_after,
                "share_of_yields": yields / max(1, yields_total),
                "ttft_p99_ms": p99_ms(mine),
            }
            rows.append(
                [
                    name if cls == classes[0] else "",
                    cls,
                    str(len(mine)),
                    f"{admitted / max(1, len(mine)):.1%}{retried}",
                    f"{yields / max(1, yields_total):.0%}",
                    fmt(p99_ms(mine)),
                ]
            )
        rate = sum(o.status == "done" for o in outcomes) / wall
        rows.append(["", "all", str(len(outcomes)), f"{preempted} preempted", "", f"{rate / rate_without:.2f}x"])
        measured[name] = {"classes": by_class, "completed_rps": rate, "preempted": preempted}
    rows.append(
        [
            "classless",
            "(no class)",
            str(len(without)),
            f"{sum(o.status != 'yield' for o in without) / len(without):.1%}",
            "-",
            fmt(p99_ms(without)),
        ]
    )
    record_classes(sitting, measured, rate_without)
    sitting.details = {
        "capacity_rps": capacity,
        "runs": measured,
        "classless": {
            "offered": len(without),
            "admitted_share": sum(o.status != "yield" for o in without) / len(without),
            "ttft_p99_ms": p99_ms(without),
            "completed_rps": rate_without,
        },
    }
    headers = ["run", "class", "offered", "admitted (kept)", "share of all yields", "TTFT p99 ms / throughput"]
    table = markdown_table(headers, rows)
    summary = ", ".join(f"{name} {run.rps:.2f}" for name, run in runs.items())
    return (
        f"1.5 C = {1.5 * capacity:.2f} req/s for {seconds:g} s, a yield final"
        " (a `preempted` one is retried at its hint).\n\n"
        f"{table}\n\ncompleted/s: {summary}; classless {rate_without:.2f}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="neighbour,weights,classes")
    worker_options(parser)
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per run")
    parser.add_argument(
        "--capacity", type=float, default=0.0, help="C in req/s instead of measuring it (to compare versions alike)"
    )
    parser.add_argument(
        "--guarantee", type=int, default=4, help="neighbour: also a run with B guaranteed_inflight=N (0: none)"
    )
    parser.add_argument(
        "--class-flags",
        type=lambda text: text.split(),
        action="append",
        default=[],
        help="classes: also a run with these governor flags (repeatable), e.g. '--preempt off'",
    )
    args = parser.parse_args()
    chosen = args.experiments.split(",")
    sittings = {part: Sitting(("govwire", "governor", "worker"), part=part) for part in EXPERIMENTS if part in chosen}
    print(f"# experiment 9 on {machine()}, model {args.model}", flush=True)
    bench = Bench(args)
    report = [f"machine: {machine()}; model {args.model}, dtype {args.dtype}, --max-inflight {MAX_INFLIGHT}\n"]
    try:
        measure = {"neighbour", "classes"} & set(chosen) and not args.capacity
        capacity = bench.capacity([], MAX_INFLIGHT, lambda _: SHORT) if measure else args.capacity
        if "neighbour" in chosen:
            report.append("### noisy neighbour\n\n" + neighbour_experiment(bench, capacity, sittings["neighbour"]))
        if "weights" in chosen:
            report.append("### weights 3:1\n\n" + weights_experiment(bench, sittings["weights"]))
        if "classes" in chosen:
            report.append("### priority classes at 150%\n\n" + classes_experiment(bench, capacity, sittings["classes"]))
    finally:
        bench.close()
    finish("tenants", report, sittings.values())


if __name__ == "__main__":
    main()
