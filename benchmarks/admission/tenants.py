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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.common import (
    fmt,
    machine,
    markdown_table,
    out_dir,
    random_text,
    start_governor,
    start_gpt2_worker,
    stats,
    stop,
)
from governor.client import NO_RETRY, AsyncClient, GovernorError, Yielded

SHORT, LONG = 32, 128
MAX_NEW = 16
MAX_INFLIGHT = 8


@dataclass(frozen=True)
class Arrival:
    at: float
    tenant: str
    priority: str | None
    prompt: str


@dataclass
class Outcome:
    arrival: Arrival
    status: str  # done | yield | error (the last attempt's)
    attempts: int
    ttft_s: float | None  # from the first submission
    reasons: tuple[str, ...] = ()  # of the yields it met, in order


def poisson(rate: float, seconds: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return times
        times.append(t)


async def one(client: AsyncClient, a: Arrival, t0: float, retry_until: float | None, victim_until: float) -> Outcome:
    """Send `a` at its time; with `retry_until`, a yield is retried after its hint until then. A
    `preempted` yield (admitted, then displaced before its first token) is retried until
    `victim_until` whatever `retry_until` says, as a client that saw its request accepted does
    (the OpenAI SDKs retry a 429). A retry sends the yield's ticket back and comes at the hint
    exactly when there is one, else with up to 20% jitter added (protocol.md)."""
    await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
    sent = time.perf_counter()
    attempts = 0
    reasons: list[str] = []
    ticket: str | None = None
    while True:
        attempts += 1
        first: float | None = None
        try:
            async with client.stream(
                a.prompt, max_new_tokens=MAX_NEW, tenant=a.tenant or None, priority=a.priority,
                temperature=0.0, stop_on_eos=False, retry_ticket=ticket,
            ) as stream:  # fmt: skip
                async for _ in stream:
                    first = first or time.perf_counter()
        except Yielded as exc:
            reasons.append(exc.reason)
            ticket = exc.retry_ticket
            wait = exc.retry_hint_ms / 1000 * (1.0 if ticket else random.uniform(1.0, 1.2))
            until = victim_until if "preempted" in reasons else retry_until
            if until is None or time.perf_counter() + wait > until:
                return Outcome(a, "yield", attempts, None, tuple(reasons))
            await asyncio.sleep(wait)
            continue
        except GovernorError:
            return Outcome(a, "error", attempts, None, tuple(reasons))
        return Outcome(a, "done", attempts, None if first is None else first - sent, tuple(reasons))


async def drive(port: int, plan: list[Arrival], retry: bool, seconds: float) -> tuple[list[Outcome], float]:
    async with AsyncClient(port=port, timeout=None, retry=NO_RETRY) as client:
        await client.connect()
        t0 = time.perf_counter()
        retry_until = t0 + seconds if retry else None
        outcomes = await asyncio.gather(*(one(client, a, t0, retry_until, t0 + seconds) for a in plan))
        return list(outcomes), time.perf_counter() - t0


def p99_ms(outcomes: list[Outcome]) -> float | None:
    values = sorted(o.ttft_s for o in outcomes if o.status == "done" and o.ttft_s is not None)
    return 1000 * values[min(len(values) - 1, int(0.99 * len(values)))] if values else None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker, self.worker_port = start_gpt2_worker("tenants", args.model, args.threads, args.dtype)

    def governor(self, name: str, *flags: str) -> tuple[Any, int]:
        return start_governor(
            "--max-inflight", str(MAX_INFLIGHT), "--integrity", "off", "--tenant-from", "frame",
            "--worker", f"127.0.0.1:{self.worker_port}", *flags, log=out_dir() / f"tenants_{name}.log",
        )  # fmt: skip

    def run(self, name: str, flags: list[str], plan: list[Arrival], retry: bool) -> tuple[list[Outcome], float]:
        proc, port = self.governor(name, *flags)
        try:
            outcomes, wall = asyncio.run(drive(port, plan, retry, self.args.seconds))
        finally:
            stop(proc)
        done = sum(o.status == "done" for o in outcomes)
        reasons = Counter(reason for o in outcomes for reason in o.reasons)
        print(f"  {name}: {done}/{len(plan)} done in {wall:.1f} s, yields {dict(reasons)}", flush=True)
        time.sleep(1.0)  # let cancelled work drain from the worker before the next run
        return outcomes, wall

    def capacity(self) -> float:
        """Completed requests/s of short prompts in a closed loop of MAX_INFLIGHT clients."""
        proc, port = self.governor("capacity")

        async def closed() -> float:
            rng = random.Random(5)
            async with AsyncClient(port=port, timeout=None, retry=NO_RETRY) as client:
                await client.connect()
                done = 0
                t0 = time.perf_counter()
                end = t0 + self.args.seconds / 2

                async def loop() -> None:
                    nonlocal done
                    while time.perf_counter() < end:
                        await client.generate(
                            random_text(rng, SHORT), max_new_tokens=MAX_NEW, temperature=0.0, stop_on_eos=False
                        )
                        done += 1

                await asyncio.gather(*(loop() for _ in range(MAX_INFLIGHT)))
                return done / (time.perf_counter() - t0)

        try:
            rate = asyncio.run(closed())
        finally:
            stop(proc)
        print(f"  capacity: {rate:.2f} req/s", flush=True)
        time.sleep(1.0)
        return rate

    def close(self) -> None:
        stop(self.worker)


def neighbour_experiment(bench: Bench, capacity: float) -> str:
    seconds = bench.args.seconds
    rng = random.Random(11)
    b_plan = [Arrival(t, "B", None, random_text(rng, SHORT)) for t in poisson(0.3 * capacity, seconds, rng)]
    a_plan = [Arrival(t, "A", None, random_text(rng, SHORT)) for t in poisson(5.0 * capacity, seconds, rng)]
    both = sorted(a_plan + b_plan, key=lambda a: a.at)
    tenants = ["--tenant", "A", "--tenant", "B"]
    runs = {
        "B alone": bench.run("neighbour_solo", tenants, b_plan, retry=True),
        "A + B, no tenants": bench.run("neighbour_anonymous", [], both, retry=True),
        "A + B, tenants 1:1": bench.run("neighbour_tenants", tenants, both, retry=True),
        "A + B, tenants 1:1, --tenant-share-from 0.5": bench.run(
            "neighbour_tenants_05", [*tenants, "--tenant-share-from", "0.5"], both, retry=True
        ),
    }
    guarantee = bench.args.guarantee
    if guarantee:
        flags = ["--tenant", "A", "--tenant", f"B,guaranteed_inflight={guarantee}"]
        runs[f"A + B, tenants 1:1, B guaranteed_inflight={guarantee}"] = bench.run(
            "neighbour_guaranteed", flags, both, retry=True
        )
    solo_b = [o for o in runs["B alone"][0] if o.arrival.tenant == "B"]
    solo_rate = sum(o.status == "done" for o in solo_b) / runs["B alone"][1]
    solo_p99 = p99_ms(solo_b)
    rows = []
    for name, (outcomes, wall) in runs.items():
        b = [o for o in outcomes if o.arrival.tenant == "B"]
        a = [o for o in outcomes if o.arrival.tenant == "A"]
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
    plan = [Arrival(t, "", rng.choice(classes), random_text(rng, SHORT)) for t in poisson(1.5 * capacity, seconds, rng)]
    classless = [Arrival(a.at, "", None, a.prompt) for a in plan]
    variants = {"classes": []} | {f"classes {' '.join(flags)}": flags for flags in bench.args.class_flags}
    runs = {name: bench.run(name.replace(" ", "_"), flags, plan, retry=False) for name, flags in variants.items()}
    without, wall_without = bench.run("classless", [], classless, retry=False)
    done_without = sum(o.status == "done" for o in without)
    rate_without = done_without / wall_without
    rows = []
    for name, (outcomes, wall) in runs.items():
        yields_total = sum(o.status == "yield" for o in outcomes)
        preempted = sum("preempted" in o.reasons for o in outcomes)
        for cls in classes:
            mine = [o for o in outcomes if o.arrival.priority == cls]
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
    summary = ", ".join(
        f"{name} {sum(o.status == 'done' for o in outcomes) / wall:.2f}" for name, (outcomes, wall) in runs.items()
    )
    return (
        f"1.5 C = {1.5 * capacity:.2f} req/s for {seconds:g} s, a yield final"
        " (a `preempted` one is retried at its hint).\n\n"
        f"{table}\n\ncompleted/s: {summary}; classless {rate_without:.2f}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="neighbour,weights,classes")
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
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
        capacity = args.capacity or (bench.capacity() if {"neighbour", "classes"} & set(chosen) else 0.0)
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
