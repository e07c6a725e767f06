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
             default, <= 1.5x with the guarantee.
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
from pathlib import Path

from benchmarks.harness.common import fmt, machine, markdown_table, out_dir, random_text, stats, stop
from benchmarks.harness.experiment import (
    MAX_NEW,
    Arrival,
    Outcome,
    Run,
    WorkerBench,
    poisson,
    ttft_ms,
    worker_options,
)
from governor.client import NO_RETRY, AsyncClient, Yielded

SHORT, LONG = 32, 128
MAX_INFLIGHT = 8


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


def neighbour_experiment(bench: Bench, capacity: float) -> str:
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
    for name, run in runs.items():
        b, a, wall = run.of(tenant="B"), run.of(tenant="A"), run.wall_s
        rate = sum(o.status == "done" for o in b) / wall
        p99 = p99_ms(b)
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
    return (
        f"capacity C = {capacity:.2f} req/s; B offers 0.3 C = {0.3 * capacity:.2f}/s, A 5 C = {5 * capacity:.2f}/s, "
        f"{seconds:g} s of arrivals, both retrying yields.\n\n{table}\n"
    )


def weights_experiment(bench: Bench) -> str:
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
    return (
        f"{seconds:g} s, 16 closed-loop clients per tenant, retrying.\n\n{table}\n\n"
        f"A:B token ratio {ratio:.2f} (3:1 target, {off:.1%} off)\n"
    )


def classes_experiment(bench: Bench, capacity: float) -> str:
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
    for name, run in runs.items():
        outcomes, wall = run.outcomes, run.wall_s
        yields_total = sum(o.status == "yield" for o in outcomes)
        preempted = sum("preempted" in o.reasons for o in outcomes)
        for cls in classes:
            mine = run.of(priority=cls)
            admitted = sum(o.status != "yield" and "preempted" not in o.reasons for o in mine)
            completed_after = sum(o.status == "done" and "preempted" in o.reasons for o in mine)
            retried = f" (+{completed_after} on retry)" if completed_after else ""
            yields = sum(o.status == "yield" for o in mine)
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
    print(f"# experiment 9 on {machine()}, model {args.model}", flush=True)
    bench = Bench(args)
    report = [f"machine: {machine()}; model {args.model}, dtype {args.dtype}, --max-inflight {MAX_INFLIGHT}\n"]
    try:
        chosen = args.experiments.split(",")
        measure = {"neighbour", "classes"} & set(chosen) and not args.capacity
        capacity = bench.capacity([], MAX_INFLIGHT, lambda _: SHORT) if measure else args.capacity
        if "neighbour" in chosen:
            report.append("### noisy neighbour\n\n" + neighbour_experiment(bench, capacity))
        if "weights" in chosen:
            report.append("### weights 3:1\n\n" + weights_experiment(bench))
        if "classes" in chosen:
            report.append("### priority classes at 150%\n\n" + classes_experiment(bench, capacity))
    finally:
        bench.close()
    text_out = "\n".join(report)
    print(text_out)
    Path(out_dir() / "tenants.md").write_text(text_out)


if __name__ == "__main__":
    main()
