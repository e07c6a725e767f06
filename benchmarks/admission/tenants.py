"""Experiment 9: admission by who — tenants' fair shares and priority classes, through the governor.

    python -m benchmarks.admission.tenants [--experiments neighbour,weights,classes] [--seconds 25] [--rounds 3]

One standalone GPT-2 worker (`worker serve`, random weights: a prompt of n ASCII characters is n
tokens) serves every run; each configuration is a `governor serve --worker` in front of it
(`--max-inflight 8`, `--tenant-from frame`), started in turn, and every configuration runs once per
round, in alternating order (harness/rounds.py). Requests are greedy with 16 new tokens,
end-of-sequence ignored. Arrivals are Poisson and seeded, so configurations compared side by side
see the same arrivals. What is measured is what a user feels: TTFT counts from a request's first
submission, retries at the hint included; a retry sends the yield's ticket back, and a `final`
yield is not retried (harness/experiment.send). Percentiles are interpolated over the outcomes of
every round pooled (n is printed beside each: at least 250 for a p99 with the defaults), rates are
medians over rounds. Each run prints what became of its refused clients' appointments (`stats`
`retry_hints`).

- capacity:  short prompts (32 tokens) in a closed loop of 8 clients: completed requests/s (C).
- neighbour: tenant B offers 0.3 C; tenant A floods at 5 C. Both retry a yield at its hint (until
             the run ends). B alone; A and B with no tenants configured (one anonymous population);
             A and B as tenants of weight 1 each; the same with B joining `--b-offset` s (3) into
             A's flood (the late joiner); the same with B's `guaranteed_inflight` (`--guarantee`, by
             default B's p99 concurrency when alone, rounded up); the same with `--tenant-loan 8`
             (B lent slots past the full cap while A holds more than its share). B's TTFT p99 against B alone: over
             the whole run, at the **onset** (B's arrivals in A's first 2 s, when nothing has
             freed yet: their count and worst), in the **steady state** (after it); B's added wait
             (first submission to the admitted one) p95; B's completed/s against alone; A's
             completed/s. Bars: steady state <= 2x solo by default; late joiner <= 3x; whole run
             <= 2x with the guarantee (stretch 1.5x); B's goodput >= 95%; A >= 0.9x its default
             throughput with the guarantee; with the loan, steady state <= 2x and A >= 0.9x.
- weights:   two backlogged tenants (16 closed-loop clients each, retrying), weights 3:1, A's
             prompts 32 tokens and B's 128: the token cost each was served (the governor's
             per-tenant settled tokens). Bar: A:B within 5% of 3:1 (the fair share's bound, 4
             requests' cost over the run, is under 2% of what 20 s serves).
- classes:   open loop at 1.5 C, a third of the arrivals each critical, standard, sheddable. The
             lower classes' yields are final (a `preempted` one is retried at its hint with its
             ticket, as an SDK retries a 429); with `--critical-retry` critical clients retry at
             their hint too, as the SDKs do. The same arrivals with no class (the same clients
             retrying); with `--allowance D[,D...]` (2) a run with `--class-allowance critical=D` each; with
             `--class-flags`, more runs with those flags (e.g. '--preempt off'). Per class the share
             admitted at the first attempt (critical's beside its Erlang B ceiling: refusing at once
             inside the cap, B(cap, load) of first attempts are refused), critical's share with a
             first token within 500 ms of its first attempt, completed requests/s against the
             classless run. Bars: critical first token within 500 ms >= 99% (retrying); first
             attempts admitted >= 99% with the allowance; sheddable takes most yields; throughput
             >= 0.95x.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
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
from benchmarks.harness.rounds import alternate, median, paired_ratio
from governor.bench.stats import percentile
from governor.client import NO_RETRY, AsyncClient, Yielded

SHORT, LONG = 32, 128
MAX_INFLIGHT = 8
EXPERIMENTS = ("neighbour", "weights", "classes")
ONSET_S = 2.0
"""The onset of A's flood: A's first requests fill the cap at once and nothing frees for about one
service time (8 / C = 0.5 s here); B's arrivals within it wait for a release whatever the hints
say, unless something admits them past the cap (a guarantee)."""
CRITICAL_SLO_S = 0.5
"""Critical work is served when its first token comes within this of its first attempt."""


def erlang_b(servers: int, load: float) -> float:
    """The share of arrivals an M/G/c/c system refuses: `servers` slots offered `load` erlangs, every
    arrival that finds them all busy refused at once (a yield that is final)."""
    blocked = 1.0
    for k in range(1, servers + 1):
        blocked = load * blocked / (k + load * blocked)
    return blocked


def pool(rounds: Sequence[dict[str, Run]], side: str) -> Run:
    """One side's outcomes of every round as one run (its wall the rounds' sum): what the
    percentiles are read from."""
    runs = [r[side] for r in rounds]
    return Run(side, [o for run in runs for o in run.outcomes], sum(run.wall_s for run in runs))


def p99(outcomes: list[Outcome]) -> float | None:
    return ttft_ms(outcomes, 0.99)


def done_n(outcomes: list[Outcome]) -> int:
    return sum(1 for o in outcomes if o.status == "done" and o.ttft_s is not None)


def concurrency_p99(outcomes: list[Outcome]) -> int:
    """How many of these requests were admitted and unfinished as each arrived (itself included),
    at the 99th percentile: the `guaranteed_inflight` that would have admitted 99% of them past a
    full cap."""
    spans = [(i, o.admitted_s, o.ended_s) for i, o in enumerate(outcomes) if o.admitted_s is not None and o.ended_s]
    counts = [
        1 + sum(1 for j, start, end in spans if j != i and start <= o.sent_s < end) for i, o in enumerate(outcomes)
    ]
    value = percentile([float(c) for c in counts], 99)
    return 0 if value is None else math.ceil(value)


class Bench(WorkerBench):
    """Every governor at `--max-inflight 8`, tenants named by the frame."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__("tenants", args, "--max-inflight", str(MAX_INFLIGHT), "--tenant-from", "frame")

    def retrying(self, name: str, flags: list[str], plan: list[Arrival]) -> Run:
        """Every yield retried at its hint until the arrivals end."""
        return self.run(name, flags, plan, retry_for_s=self.args.seconds, victims_retry_for_s=self.args.seconds)

    def classes_run(self, name: str, flags: list[str], plan: list[Arrival]) -> Run:
        """A yield final, but a `preempted` one retried at its hint until the arrivals end, and with
        `--critical-retry` every yield of a critical client (`Arrival.kind`, which the classless
        twin keeps)."""
        critical: Callable[[Arrival], bool] = lambda a: a.kind == "critical"  # noqa: E731
        retry_for = self.args.seconds if self.args.critical_retry else None
        return self.run(
            name, flags, plan, retry_for_s=retry_for, retries=critical, victims_retry_for_s=self.args.seconds
        )


# -- noisy neighbour -------------------------------------------------------------------------------


def b_rate(run: Run) -> float:
    return sum(o.status == "done" for o in run.of(tenant="B")) / run.wall_s


def a_rate(run: Run) -> float:
    return sum(o.status == "done" for o in run.of(tenant="A")) / run.wall_s


def b_figures(run: Run, solo_p99: float | None, offset: float) -> dict[str, float | None]:
    """B's side of one pooled run: rates per second of the run, TTFT percentiles and their counts."""
    b, a = run.of(tenant="B"), run.of(tenant="A")
    onset = [o for o in b if o.sent_s - offset < ONSET_S] if offset == 0 else []
    steady = [o for o in b if o.sent_s - offset >= ONSET_S] if offset == 0 else b
    waits = [w for o in b if (w := o.added_wait_s) is not None]
    onset_done = [o.ttft_s for o in onset if o.status == "done" and o.ttft_s is not None]
    whole, steady_p99 = p99(b), p99(steady)
    return {
        "b_completed_rps": sum(o.status == "done" for o in b) / run.wall_s,
        "b_ttft_p99_ms": whole,
        "b_ttft_n": done_n(b),
        "b_ttft_p99_vs_solo": whole / solo_p99 if whole is not None and solo_p99 else None,
        "b_steady_ttft_p99_ms": steady_p99,
        "b_steady_n": done_n(steady),
        "b_steady_vs_solo": steady_p99 / solo_p99 if steady_p99 is not None and solo_p99 else None,
        "b_onset_n": len(onset_done),
        "b_onset_ttft_max_ms": 1000 * max(onset_done) if onset_done else None,
        "b_added_wait_p95_ms": None if (w := percentile(waits, 95)) is None else 1000 * w,
        "b_retries_per_request": sum(o.attempts - 1 for o in b) / max(1, len(b)),
        "b_not_done": sum(o.status != "done" for o in b),
        "b_done_share": sum(o.status == "done" for o in b) / max(1, len(b)),
        "a_completed_rps": sum(o.status == "done" for o in a) / run.wall_s if a else None,
    }


def neighbour_experiment(bench: Bench, capacity: float, sitting: Sitting) -> str:
    args = bench.args
    seconds, offset = args.seconds, args.b_offset
    rng = random.Random(11)
    b_plan = [Arrival(t, random_text(rng, SHORT), tenant="B") for t in poisson(0.3 * capacity, seconds, rng)]
    a_plan = [Arrival(t, random_text(rng, SHORT), tenant="A") for t in poisson(5.0 * capacity, seconds, rng)]
    both = sorted(a_plan + b_plan, key=lambda a: a.at)
    late_b = [Arrival(a.at + offset, a.prompt, tenant="B") for a in b_plan if a.at + offset < seconds]
    late = sorted(a_plan + late_b, key=lambda a: a.at)
    tenants = ["--tenant", "A", "--tenant", "B"]
    guarantee: list[int] = [args.guarantee]  # sized from B alone in the first round when 0

    def guaranteed() -> Run:
        flags = ["--tenant", "A", "--tenant", f"B,guaranteed_inflight={guarantee[0]}"]
        return bench.retrying("neighbour_guaranteed", flags, both)

    def solo() -> Run:
        run = bench.retrying("neighbour_solo", tenants, b_plan)
        if not guarantee[0]:
            guarantee[0] = max(1, concurrency_p99(run.of(tenant="B")))
            print(f"  B's p99 concurrency alone: {guarantee[0]} (the guarantee)", flush=True)
        return run

    sides: dict[str, Callable[[], Run]] = {
        "B alone": solo,
        "A + B, no tenants": lambda: bench.retrying("neighbour_anonymous", [], both),
        "A + B, tenants 1:1": lambda: bench.retrying("neighbour_tenants", tenants, both),
        f"A + B, tenants 1:1, B joins at {offset:g} s": lambda: bench.retrying("neighbour_late", tenants, late),
        "A + B, tenants 1:1, B guaranteed": guaranteed,
        # A quiet tenant lent slots past the cap (opt-in), as much as the cap (the flood holds no more).
        f"A + B, tenants 1:1, --tenant-loan {MAX_INFLIGHT}": lambda: bench.retrying(
            "neighbour_loan", [*tenants, "--tenant-loan", str(MAX_INFLIGHT)], both
        ),
    }
    rounds = alternate(args.rounds, sides)
    pooled = {side: pool(rounds, side) for side in sides}
    solo_b = pooled["B alone"].of(tenant="B")
    solo_p99 = p99(solo_b)
    measured: dict[str, dict[str, float | None]] = {}
    for side, run in pooled.items():
        row = b_figures(run, solo_p99, offset if "joins" in side else 0.0)
        row["b_completed_rps"] = median(rounds, side, b_rate)
        row["a_completed_rps"] = median(rounds, side, a_rate) if run.of(tenant="A") else None
        measured[side] = row
    record_neighbour(sitting, measured, rounds, guarantee[0], offset)
    rows = [
        [
            side,
            f"{m['b_completed_rps']:.2f} ({paired_ratio(rounds, side, 'B alone', b_rate) or 0:.0%}), "
            f"{m['b_done_share']:.1%} of offered",
            f"{fmt(m['b_ttft_p99_ms'])} ({fmt(m['b_ttft_p99_vs_solo'], 2)}x, n {m['b_ttft_n']:.0f})",
            "-" if m["b_onset_ttft_max_ms"] is None else f"{fmt(m['b_onset_ttft_max_ms'])} (n {m['b_onset_n']:.0f})",
            f"{fmt(m['b_steady_ttft_p99_ms'])} ({fmt(m['b_steady_vs_solo'], 2)}x, n {m['b_steady_n']:.0f})",
            fmt(m["b_added_wait_p95_ms"]),
            f"{m['b_retries_per_request']:.2f}",
            "-" if m["a_completed_rps"] is None else f"{m['a_completed_rps']:.2f}",
        ]
        for side, m in measured.items()
    ]
    table = markdown_table(
        [
            "run",
            "B completed/s (vs alone), done of offered",
            "B TTFT p99 ms (vs alone, n)",
            "B onset worst ms (n)",
            "B steady-state TTFT p99 ms (vs alone, n)",
            "B added wait p95 ms",
            "B retries per request",
            "A completed/s",
        ],
        rows,
    )
    sitting.details = {
        "capacity_rps": capacity,
        "rounds": args.rounds,
        "seconds": seconds,
        "b_offset_s": offset,
        "guarantee": guarantee[0],
        "runs": measured,
        "hint_outcomes": {
            side: [r[side].stats.get("retry_hints", {}).get("outcomes") for r in rounds] for side in sides
        },
    }
    return (
        f"capacity C = {capacity:.2f} req/s; B offers 0.3 C = {0.3 * capacity:.2f}/s, A 5 C = {5 * capacity:.2f}/s, "
        f"{seconds:g} s of arrivals, {args.rounds} rounds pooled, both retrying yields at the hint; onset = B's "
        f"arrivals in A's first {ONSET_S:g} s; B's guarantee {guarantee[0]} (B's p99 concurrency alone, per round: "
        f"{[concurrency_p99(r['B alone'].of(tenant='B')) for r in rounds]}; its TTFT p99 ms per round: "
        f"{[fmt(p99(r['B alone'].of(tenant='B'))) for r in rounds]}).\n\n{table}\n\n"
        f"B's added wait in the steady state of the tenants 1:1 run, by how many of B's requests were in flight "
        f"as it arrived (A's share past the threshold leaves B about {MAX_INFLIGHT - int(0.8 * MAX_INFLIGHT)} "
        f"slots at once; past them B waits for releases, its own earlier appointments first):\n\n"
        f"{wait_by_concurrency(rounds, 'A + B, tenants 1:1')}\n"
    )


def wait_by_concurrency(rounds: Sequence[dict[str, Run]], side: str) -> str:
    """A table: B's steady-state arrivals grouped by the other B requests admitted and unfinished
    when each arrived, with the p50 / p95 of their added wait (first submission to the admitted
    one), over every round (each round's outcomes against its own clock)."""
    groups: dict[str, list[float]] = {"0-1": [], "2-3": [], "4-5": [], "6+": []}
    for r in rounds:
        b = r[side].of(tenant="B")
        spans = [(o.admitted_s, o.ended_s) for o in b if o.admitted_s is not None and o.ended_s is not None]
        for o in b:
            wait = o.added_wait_s
            if o.sent_s < ONSET_S or wait is None:
                continue
            others = sum(1 for start, end in spans if start < o.sent_s < end)
            key = "0-1" if others <= 1 else "2-3" if others <= 3 else "4-5" if others <= 5 else "6+"
            groups[key].append(wait)
    rows = [
        [key, str(len(waits)), fmt(ms(percentile(waits, 50))), fmt(ms(percentile(waits, 95)))]
        for key, waits in groups.items()
    ]
    return markdown_table(["B in flight as it arrived", "arrivals", "added wait p50 ms", "p95 ms"], rows)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def record_neighbour(
    sitting: Sitting,
    measured: dict[str, dict[str, float | None]],
    rounds: Sequence[dict[str, Run]],
    guarantee: int,
    offset: float,
) -> None:
    """B beside A's flood against B alone (the bars: this script's docstring)."""
    solo = measured["B alone"]
    tenants, late, guaranteed = (
        "A + B, tenants 1:1",
        f"A + B, tenants 1:1, B joins at {offset:g} s",
        "A + B, tenants 1:1, B guaranteed",
    )

    def p99_figure(label: str, side: str, key: str, n_key: str, bar: float | None, headline: bool) -> None:
        value, base = measured[side][key], solo["b_ttft_p99_ms"]
        ratio = value / base if value is not None and base else None
        steady = key.startswith("b_steady")
        offset_of = offset if "joins" in side else 0.0

        def b_p99(run: Run) -> float | None:  # one round's, for the paired ratio beside the pooled one
            b = run.of(tenant="B")
            return p99([o for o in b if o.sent_s - offset_of >= ONSET_S] if steady and not offset_of else b)

        paired = paired_ratio(rounds, side, "B alone", b_p99)
        sitting.figure(
            label,
            value,
            "ms",
            baseline=("B alone", base),
            bar=None if bar is None else f"ratio <= {bar:g}",
            met=None if bar is None or ratio is None else ratio <= bar,
            headline=headline,
            note=f"n {measured[side][n_key]:.0f} (alone {solo['b_ttft_n']:.0f}), {len(rounds)} rounds pooled; "
            f"median of the rounds' own ratios {fmt(paired, 2)}x",
        )

    p99_figure(
        "B TTFT p99, steady state, A at 5 C, tenants 1:1", tenants, "b_steady_ttft_p99_ms", "b_steady_n", 2.0, True
    )
    p99_figure("B TTFT p99, whole run, A at 5 C, tenants 1:1", tenants, "b_ttft_p99_ms", "b_ttft_n", None, False)
    p99_figure(f"B TTFT p99, B joining {offset:g} s into A's flood", late, "b_ttft_p99_ms", "b_ttft_n", 3.0, True)
    p99_figure(
        f"B TTFT p99, whole run, B guaranteed_inflight={guarantee}", guaranteed, "b_ttft_p99_ms", "b_ttft_n", 2.0, True
    )
    p99_figure(
        "B TTFT p99, steady state, A at 5 C, no tenants",
        "A + B, no tenants",
        "b_steady_ttft_p99_ms",
        "b_steady_n",
        None,
        False,
    )
    onset = measured[tenants]
    sitting.figure(
        "B TTFT at the onset (worst), A at 5 C, tenants 1:1",
        onset["b_onset_ttft_max_ms"],
        "ms",
        baseline=("B alone, p99", solo["b_ttft_p99_ms"]),
        headline=False,
        note=f"B's {onset['b_onset_n']:.0f} arrivals in A's first {ONSET_S:g} s over {len(rounds)} rounds: a maximum",
    )
    for side, bar in ((tenants, 0.95), (guaranteed, 0.95), (late, None)):
        ratio = paired_ratio(rounds, side, "B alone", b_rate)
        sitting.figure(
            f"B completed/s, {side.removeprefix('A + B, ')}",
            measured[side]["b_completed_rps"],
            "req/s",
            baseline=("B alone", solo["b_completed_rps"]),
            ratio=ratio,
            bar=None if bar is None else f"ratio >= {bar:g}",
            met=None if bar is None or ratio is None else ratio >= bar,
            headline=bar is not None and side == tenants,
        )

    def a_figure(label: str, side: str, baseline: str) -> None:
        """A's throughput in `side` against the tenants 1:1 run (bar: >= 0.9x)."""
        ratio = paired_ratio(rounds, side, tenants, a_rate)
        sitting.figure(
            label,
            measured[side]["a_completed_rps"],
            "req/s",
            baseline=(baseline, measured[tenants]["a_completed_rps"]),
            ratio=ratio,
            bar="ratio >= 0.9",
            met=None if ratio is None else ratio >= 0.9,
            headline=False,
        )

    a_figure(f"A completed/s, B guaranteed_inflight={guarantee}", guaranteed, "tenants 1:1, no guarantee")
    sitting.figure("B added wait p95, tenants 1:1", onset["b_added_wait_p95_ms"], "ms", headline=False)
    # The quiet tenant lent slots past the cap (issue 60's bars: B steady <= 2x alone, A >= 0.9x).
    loaned = f"A + B, tenants 1:1, --tenant-loan {MAX_INFLIGHT}"
    p99_figure(
        f"B TTFT p99, steady state, --tenant-loan {MAX_INFLIGHT}",
        loaned,
        "b_steady_ttft_p99_ms",
        "b_steady_n",
        2.0,
        True,
    )
    a_figure(f"A completed/s, --tenant-loan {MAX_INFLIGHT}", loaned, "tenants 1:1, no loan")


# -- weights ---------------------------------------------------------------------------------------


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
    # The fair share's bound (docs/operations.md): the weighted costs admitted differ by at most 4 of
    # the largest request's (B's: 128 + 16 tokens at weight 1) over any window it holds in.
    bound = 4 * (LONG + MAX_NEW) / max(1, b["tokens_settled_total"])
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
    sitting.figure(
        "A:B tokens served, weights 3:1",
        ratio,
        "x",
        bar="within 5% of 3",
        met=off <= 0.05,
        note=f"{seconds:g} s backlogged: the share's bound is {bound:.1%} of B's tokens",
    )
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
        f"A:B token ratio {ratio:.2f} (3:1 target, {off:.1%} off; the fair share's bound over this run: "
        f"{bound:.1%} of B's tokens, so {seconds:g} s resolves 5%)\n"
    )


# -- priority classes ------------------------------------------------------------------------------

CLASSES = ("critical", "standard", "sheddable")


def first_attempt_admitted(o: Outcome) -> bool:
    """Admitted at its first attempt and kept (not displaced)."""
    return o.attempts == 1 and o.status != "yield" and "preempted" not in o.reasons


def class_figures(run: Run, rounds: Sequence[dict[str, Run]], side: str) -> dict[str, Any]:
    outcomes = run.outcomes
    yields_total = sum(bool(o.reasons) for o in outcomes)
    by_class: dict[str, dict[str, float | None]] = {}
    for cls in CLASSES:
        mine = run.of(priority=cls) or [o for o in outcomes if o.arrival.kind == cls]
        by_class[cls] = {
            "offered": len(mine),
            "first_attempt_admitted_share": sum(map(first_attempt_admitted, mine)) / max(1, len(mine)),
            "first_token_within_500ms_share": sum(o.first_token_within(CRITICAL_SLO_S) for o in mine)
            / max(1, len(mine)),
            "done_share": sum(o.status == "done" for o in mine) / max(1, len(mine)),
            "share_of_yields": sum(bool(o.reasons) for o in mine) / max(1, yields_total),
            "ttft_p99_ms": p99(mine),
            "ttft_n": done_n(mine),
            "preempted": sum("preempted" in o.reasons for o in mine),
        }
    return {
        "classes": by_class,
        "completed_rps": median(rounds, side, lambda r: r.rps),
        "preempted": sum("preempted" in o.reasons for o in outcomes),
    }


def record_classes(
    sitting: Sitting,
    measured: dict[str, dict[str, Any]],
    rounds: Sequence[dict[str, Run]],
    retrying: bool,
    ceilings: dict[str, float],
) -> None:
    """Per classes run (the default one's are the headlines), against the classless run (the
    bars: this script's docstring)."""
    classless = measured["classless"]
    for side, run in measured.items():
        if side == "classless":
            continue
        label = "" if side == "classes" else f", {side.removeprefix('classes, ')}"
        headline = side == "classes" or "allowance" in side
        critical = run["classes"]["critical"]
        if retrying:
            share = critical["first_token_within_500ms_share"]
            sitting.figure(
                f"critical first token within 500 ms of its first attempt, retrying at the hint, 1.5 C{label}",
                100 * share,
                "%",
                bar=">= 99%",
                met=share >= 0.99,
                headline=headline,
                note=f"{critical['offered']:.0f} critical requests, {len(rounds)} rounds",
            )
        first = critical["first_attempt_admitted_share"]
        allowance = "allowance" in side
        ceiling = ceilings.get(side)
        sitting.figure(
            f"critical admitted at the first attempt, 1.5 C{label}",
            100 * first,
            "%",
            bar=">= 99%" if allowance else None,
            met=first >= 0.99 if allowance else None,
            headline=headline,
            note="" if ceiling is None else f"Erlang B ceiling refusing at once: {100 * (1 - ceiling):.1f}%",
        )
        sheddable = run["classes"]["sheddable"]["share_of_yields"]
        sitting.figure(
            f"sheddable's share of all yields at 1.5 C{label}",
            100 * sheddable,
            "%",
            bar="the largest of the classes",
            met=all(sheddable >= c["share_of_yields"] for c in run["classes"].values()),
            headline=False,
        )
        ratio = paired_ratio(rounds, side, "classless", lambda r: r.rps)
        sitting.figure(
            f"completed/s with classes at 1.5 C{label}",
            run["completed_rps"],
            "req/s",
            baseline=("no classes", classless["completed_rps"]),
            ratio=ratio,
            bar="ratio >= 0.95",
            met=None if ratio is None else ratio >= 0.95,
            headline=headline,
        )
        for cls in ("standard", "sheddable"):
            sitting.figure(
                f"{cls} admitted at the first attempt at 1.5 C{label}",
                100 * run["classes"][cls]["first_attempt_admitted_share"],
                "%",
                headline=False,
            )
        sitting.figure(f"displaced (preempted) at 1.5 C{label}", run["preempted"], "requests", headline=False)


def classes_experiment(bench: Bench, capacity: float, sitting: Sitting) -> str:
    args = bench.args
    seconds = args.seconds
    rng = random.Random(17)
    plan = []
    for t in poisson(1.5 * capacity, seconds, rng):
        cls = rng.choice(CLASSES)  # drawn in this order
        plan.append(Arrival(t, priority=cls, kind=cls, prompt=random_text(rng, SHORT)))
    classless_plan = [Arrival(a.at, a.prompt, kind=a.kind) for a in plan]  # the same clients, no class
    variants: dict[str, list[str]] = {"classes": []}
    allowances = {f"classes, --class-allowance critical={d}": d for d in args.allowance}
    for side, d in allowances.items():
        variants[side] = ["--class-allowance", f"critical={d}"]
    variants |= {f"classes, {' '.join(flags)}": flags for flags in args.class_flags}
    sides: dict[str, Callable[[], Run]] = {
        side: partial(bench.classes_run, re.sub(r"[^a-z0-9=]+", "_", side), flags, plan)
        for side, flags in variants.items()
    }
    sides["classless"] = lambda: bench.classes_run("classless", [], classless_plan)
    rounds = alternate(args.rounds, sides)
    measured = {side: class_figures(pool(rounds, side), rounds, side) for side in sides}
    # Critical's offered load in erlangs: its arrival rate times a service time at the full cap.
    critical_rate = sum(a.kind == "critical" for a in plan) / seconds
    load = critical_rate * MAX_INFLIGHT / capacity
    ceilings = {side: 1 - erlang_b(MAX_INFLIGHT + allowances.get(side, 0), load) for side in variants}
    record_classes(sitting, measured, rounds, args.critical_retry, ceilings)
    rows = []
    for side, run in measured.items():
        for cls in CLASSES:
            c = run["classes"][cls]
            ceiling = f" (ceiling {ceilings[side]:.1%})" if cls == "critical" and side in ceilings else ""
            rows.append(
                [
                    side if cls == CLASSES[0] else "",
                    cls if side != "classless" else f"({cls} clients)",
                    f"{c['offered']:.0f}",
                    f"{c['first_attempt_admitted_share']:.1%}{ceiling}",
                    f"{c['first_token_within_500ms_share']:.1%}",
                    f"{c['share_of_yields']:.0%}",
                    f"{fmt(c['ttft_p99_ms'])} (n {c['ttft_n']:.0f})",
                ]
            )
        ratio = paired_ratio(rounds, side, "classless", lambda r: r.rps)
        rows.append(
            ["", "all", "", f"{run['preempted']} preempted", "", "", f"{run['completed_rps']:.2f}/s ({fmt(ratio, 2)}x)"]
        )
    sitting.details = {
        "capacity_rps": capacity,
        "rounds": args.rounds,
        "seconds": seconds,
        "critical_retry": args.critical_retry,
        "critical_load_erlangs": load,
        "first_attempt_ceilings": ceilings,
        "runs": measured,
        "hint_outcomes": {
            side: [r[side].stats.get("retry_hints", {}).get("outcomes") for r in rounds] for side in sides
        },
    }
    headers = [
        "run",
        "class",
        "offered",
        "admitted at the first attempt (Erlang B ceiling)",
        "first token within 500 ms of the first attempt",
        "share of runs' yields",
        "TTFT p99 ms (n) / completed/s",
    ]
    retry = "critical clients retry at the hint with their ticket" if args.critical_retry else "critical yields final"
    return (
        f"1.5 C = {1.5 * capacity:.2f} req/s for {seconds:g} s, {args.rounds} rounds pooled; {retry}, the lower "
        f"classes' yields final (a `preempted` one is retried at its hint); critical offers {load:.2f} erlangs.\n\n"
        f"{markdown_table(headers, rows)}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="neighbour,weights,classes")
    worker_options(parser)
    parser.add_argument("--seconds", type=float, default=25.0, help="arrivals per run")
    parser.add_argument("--rounds", type=int, default=3, help="neighbour, classes: rounds, pooled")
    parser.add_argument(
        "--capacity", type=float, default=0.0, help="C in req/s instead of measuring it (to compare versions alike)"
    )
    parser.add_argument(
        "--guarantee", type=int, default=0, help="neighbour: B's guaranteed_inflight (0: B's p99 concurrency alone)"
    )
    parser.add_argument("--b-offset", type=float, default=3.0, help="neighbour: the late joiner's start, s")
    parser.add_argument(
        "--critical-retry", action="store_true", help="classes: critical clients retry at their hint, as the SDKs do"
    )
    parser.add_argument(
        "--allowance",
        type=lambda text: [int(d) for d in text.split(",") if d],
        default=[2],
        help="classes: a run with --class-allowance critical=D for each D of this list (2)",
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
