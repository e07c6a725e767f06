"""Experiment 8: admission by token cost, by deadline and by an adaptive limit, through the governor.

    python -m benchmarks.admission.token_admission [--experiments mix,deadline,adaptive] [--seconds 20]

One standalone GPT-2 worker (`worker serve`, random weights: its tokenizer is bytes, so a prompt
of n ASCII characters is n tokens) serves every run; each configuration is a `governor serve
--worker` in front of it, started in turn. Requests arrive open-loop (Poisson, seeded: every
configuration sees the same arrivals), 16 new tokens each, greedy, end-of-sequence ignored; a
yield is final (no retry), so what is measured is what the governor let in.

- capacity: the mix below in a closed loop of 16 clients, no cap: completed requests/s. The open
            loops run at 150% of it.
- mix:      90% short prompts (32 tokens), 10% long (896: GPT-2's context is 1,024), a request cap
            alone (--max-inflight swept) against a token budget (--max-inflight-tokens swept under
            --max-inflight 64); each at its best (most goodput). Short requests' TTFT p99,
            completed requests/s, goodput (TTFT <= --slo-ms).
- deadline: the mix at 150% with deadline_ms = --slo-ms on every frame, against the same arrivals
            without it, --max-inflight 32, `--rounds` times. Of the frames sent with a deadline the
            share served in time; of the admitted the share that met it; of the refused the share
            whose twin in the same round's run without deadlines missed (refusal precision); the
            governor's prediction coverage (stats.deadlines); goodput against the twin.
- adaptive: short prompts only at 150% of their capacity; half-way through, two CPU-bound
            processes start on the same machine (the engine's capacity roughly halves). A fixed
            --max-inflight swept before the change; the best fixed one, --adaptive-limit enforce
            and shadow run across the change in `--rounds` alternating rounds: TTFT p99
            before/after (each run's ratio, their median), the engine's utilisation (busy seconds
            per second), the limit over time and how long it took to settle.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
from functools import partial
from operator import itemgetter

from benchmarks.harness.common import fmt, machine, markdown_table, random_text
from benchmarks.harness.experiment import Arrival, Run, WorkerBench, finish, worker_options
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import alternate, median, paired_ratio

SHORT, LONG = 32, 896
EXPERIMENTS = ("mix", "deadline", "adaptive")


def arrivals(rate: float, seconds: float, long_share: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        kind = "long" if rng.random() < long_share else "short"
        out.append(Arrival(t, random_text(rng, LONG if kind == "long" else SHORT), kind))


class Bench(WorkerBench):
    """A yield final; the governor's stats polled every 0.5 s."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__("token_admission", args)

    def open_loop(self, name: str, flags: list[str], plan: list[Arrival], deadline_ms: float = 0.0) -> Run:
        run = self.run(name, flags, plan, deadline_ms=deadline_ms, poll_s=0.5)
        print(
            f"    short TTFT p99 {run.ttft_ms(0.99, 'short') or 0:.0f} ms, "
            f"goodput {run.goodput(self.args.slo_ms / 1000):.2f}/s",
            flush=True,
        )
        return run

    def mix_capacity(self, long_share: float) -> float:
        """Completed requests/s of the mix in a closed loop of 16 clients, no cap."""
        return self.capacity(["--max-inflight", "1000"], 16, lambda rng: LONG if rng.random() < long_share else SHORT)


def mix_row(run: Run, slo: float) -> dict[str, float | None]:
    """A run's row of the mix table as numbers, for the result file."""
    return {
        "short_ttft_p50_ms": run.ttft_ms(0.5, "short"),
        "short_ttft_p99_ms": run.ttft_ms(0.99, "short"),
        "long_ttft_p99_ms": run.ttft_ms(0.99, "long"),
        "done_rps": run.rps,
        "goodput_rps": run.goodput(slo),
        "yields": run.count("yield"),
    }


def mix_experiment(bench: Bench, capacity: float, sitting: Sitting) -> str:
    args = bench.args
    plan = arrivals(1.5 * capacity, args.seconds, 0.1, seed=1)
    slo = args.slo_ms / 1000
    caps = [bench.open_loop(f"cap{c}", ["--max-inflight", str(c)], plan) for c in (2, 4, 8, 16)]
    budgets = [
        bench.open_loop(f"tokens{t}", ["--max-inflight", "64", "--max-inflight-tokens", str(t)], plan)
        for t in (1200, 2000, 3200)
    ]
    best_cap = max(caps, key=lambda r: r.goodput(slo))
    best_budget = max(budgets, key=lambda r: r.goodput(slo))
    rows = [
        [
            r.name + (" (best)" if r in (best_cap, best_budget) else ""),
            fmt(r.ttft_ms(0.5, "short")),
            fmt(r.ttft_ms(0.99, "short")),
            fmt(r.ttft_ms(0.99, "long")),
            f"{r.rps:.2f}",
            f"{r.goodput(slo):.2f}",
            str(r.count("yield")),
        ]
        for r in caps + budgets
    ]
    p99_cap, p99_budget = best_cap.ttft_ms(0.99, "short"), best_budget.ttft_ms(0.99, "short")
    ratio = (p99_cap or 0) / (p99_budget or 1)
    gain = best_budget.goodput(slo) / max(best_cap.goodput(slo), 1e-9)
    # The docs' bar (short TTFT p99 cut >= 3x at >= 0.95x the throughput) is for the budget that keeps
    # short requests fastest; the line printed below compares the budget with the most goodput.
    fastest = min(budgets, key=lambda r: r.ttft_ms(0.99, "short") or float("inf"))
    p99_fastest = fastest.ttft_ms(0.99, "short")
    p99_ratio = p99_fastest / p99_cap if p99_fastest is not None and p99_cap else None
    throughput = fastest.rps / best_cap.rps
    best = "best request cap"
    note = f"{fastest.name} against {best_cap.name}"
    sitting.figure(
        "short TTFT p99, fastest token budget",
        p99_fastest,
        "ms",
        baseline=(best, p99_cap),
        bar="ratio <= 0.33 (cut >= 3x)",
        met=None if p99_ratio is None else p99_ratio <= 1 / 3,
        note=note,
    )
    sitting.figure(
        "completed/s, fastest token budget",
        fastest.rps,
        "req/s",
        baseline=(best, best_cap.rps),
        bar="ratio >= 0.95",
        met=throughput >= 0.95,
        note=note,
    )
    note = f"{best_budget.name} against {best_cap.name}"
    for name, value, base, unit in (
        ("short TTFT p99", p99_budget, p99_cap, "ms"),
        ("completed/s", best_budget.rps, best_cap.rps, "req/s"),
        ("goodput", best_budget.goodput(slo), best_cap.goodput(slo), "req/s"),
    ):
        sitting.figure(f"{name}, best token budget", value, unit, baseline=(best, base), headline=False, note=note)
    sitting.details = {
        "arrivals_rps": 1.5 * capacity,
        "capacity_rps": capacity,
        "requests": len(plan),
        "runs": {r.name: mix_row(r, slo) for r in caps + budgets},
    }
    return (
        f"arrivals {1.5 * capacity:.2f}/s (150% of {capacity:.2f}), {len(plan)} requests, 10% long\n\n"
        + markdown_table(
            [
                "config",
                "short TTFT p50 ms",
                "short TTFT p99 ms",
                "long TTFT p99 ms",
                "done/s",
                f"goodput/s (TTFT <= {args.slo_ms:g} ms)",
                "yields",
            ],
            rows,
        )
        + f"\n\nbest token budget vs best request cap: short TTFT p99 {ratio:.2f}x lower, throughput "
        f"{best_budget.rps / best_cap.rps:.2f}x, goodput {gain:.2f}x\n"
    )


def deadline_figures(rounds: list[dict[str, Run]], slo: float) -> dict[str, float | int | None]:
    """What a deadline caller feels, over every round: of the frames sent with a deadline, those
    served in time (the in-time share of all), those admitted that met it, those admitted that
    expired, and those refused at once whose twin in the same round's run without deadlines missed
    it (done late or not done: the refusal was right); the governor's own count of predictions
    covered (stats.deadlines)."""
    sent = met = admitted = expired = refused = right = covered = predicted = 0
    for r in rounds:
        plain, aware = r["no_deadline"], r["deadline"]
        sent += len(aware.outcomes)
        done = aware.done()
        met += sum(1 for o in done if o.ttft_s is not None and o.ttft_s <= slo)
        expired += aware.count("error", "deadline_exceeded")
        admitted += len(done) + aware.count("error", "deadline_exceeded")
        for i, o in enumerate(aware.outcomes):
            if o.status == "yield" and o.code == "deadline":
                refused += 1
                twin = plain.outcomes[i]
                right += twin.status != "done" or (twin.ttft_s or 0) > slo
        deadlines = aware.stats.get("deadlines") or {}
        covered += deadlines.get("covered", 0)
        predicted += deadlines.get("covered", 0) + deadlines.get("exceeded", 0)
    return {
        "sent": sent,
        "admitted": admitted,
        "met": met,
        "expired": expired,
        "refused": refused,
        "refused_whose_twin_missed": right,
        "in_time_share": met / sent if sent else None,
        "met_share": met / admitted if admitted else None,
        "expired_share": expired / admitted if admitted else None,
        "refusal_precision": right / refused if refused else None,
        "coverage": covered / predicted if predicted else None,
        "predicted": predicted,
    }


def deadline_experiment(bench: Bench, capacity: float, sitting: Sitting) -> str:
    args = bench.args
    plan = arrivals(1.5 * capacity, args.seconds, 0.1, seed=2)
    slo = args.slo_ms / 1000
    flags = ["--max-inflight", "32"]
    paired = alternate(
        args.rounds,
        {
            "no_deadline": lambda: bench.open_loop("no_deadline", flags, plan),
            "deadline": lambda: bench.open_loop("deadline", flags, plan, deadline_ms=args.slo_ms),
        },
    )
    f = deadline_figures(paired, slo)
    goodput = {side: median(paired, side, lambda run: run.goodput(slo)) for side in ("no_deadline", "deadline")}
    gain = paired_ratio(paired, "deadline", "no_deadline", lambda run: run.goodput(slo))

    def pct(key: str) -> float | None:
        value = f[key]
        return None if value is None else 100 * value

    def bar(key: str, low: float, high: float) -> bool | None:
        value = f[key]
        return None if value is None else low <= value <= high

    n = f"{f['sent']} frames with a deadline over {args.rounds} rounds"
    sitting.figure(
        f"goodput with deadline_ms {args.slo_ms:g}",
        goodput["deadline"],
        "req/s",
        baseline=("without deadlines", goodput["no_deadline"]),
        ratio=gain,
        bar="ratio >= 1.3",
        met=None if gain is None else gain >= 1.3,
    )
    for name, key, bar_text, low, high, note in (
        ("admitted requests that met their deadline", "met_share", ">= 95%", 0.95, 1.0, f"{f['admitted']} admitted"),
        ("frames with a deadline served in time", "in_time_share", ">= 90%", 0.9, 1.0, n),
        (
            "deadline refusals whose twin without a deadline missed it",
            "refusal_precision", ">= 80%", 0.8, 1.0, f"{f['refused']} refused",
        ),
        (
            "admitted first tokens within their prediction (coverage)",
            "coverage", "93-97%", 0.93, 0.97, f"{f['predicted']} predicted (stats.deadlines)",
        ),
    ):  # fmt: skip
        sitting.figure(name, pct(key), "%", bar=bar_text, met=bar(key, low, high), note=note)
    sitting.figure("expired share of the admitted", pct("expired_share"), "%", headline=False)
    sitting.details = {"arrivals_rps": 1.5 * capacity, "capacity_rps": capacity, "requests": len(plan), **f}
    rows = [
        [
            "without deadlines",
            str(sum(len(r["no_deadline"].done()) for r in paired)),
            "-",
            "-",
            "-",
            "-",
            fmt(goodput["no_deadline"], 2),
        ],
        [
            f"deadline_ms {args.slo_ms:g}",
            str(sum(len(r["deadline"].done()) for r in paired)),
            f"{f['met']}/{f['admitted']} ({fmt(pct('met_share'), 1)}%)",
            f"{f['met']}/{f['sent']} ({fmt(pct('in_time_share'), 1)}%)",
            f"{f['expired']}",
            f"{f['refused']} ({fmt(pct('refusal_precision'), 0)}% twin missed)",
            fmt(goodput["deadline"], 2),
        ],
    ]
    return (
        f"arrivals {1.5 * capacity:.2f}/s (150% of {capacity:.2f}), {len(plan)} requests per run, --max-inflight 32, "
        f"{args.rounds} rounds\n\n"
        + markdown_table(
            [
                "run",
                "done",
                "admitted that met the deadline",
                "sent that were served in time",
                "expired (cancelled)",
                "refused (deadline)",
                f"goodput/s (TTFT <= {args.slo_ms:g} ms), median",
            ],
            rows,
        )
        + f"\n\ngoodput with deadlines / without: {fmt(gain, 2)}x (median of rounds); predictions covered "
        f"{fmt(pct('coverage'), 1)}% of {f['predicted']} (stats.deadlines)\n"
    )


def busy_ratio(run: Run, since: float, until: float) -> float | None:
    points = [p for p in run.timeline if since <= p["t"] <= until]
    if len(points) < 2:
        return None
    return (points[-1]["busy"] - points[0]["busy"]) / (points[-1]["t"] - points[0]["t"])


def hog(seconds: float) -> list[subprocess.Popen[bytes]]:
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]


def record_adaptive(
    sitting: Sitting,
    changes: dict[str, dict[str, float | None]],
    best_cap: int,
    recommended: float | None,
    rounds: int,
) -> None:
    """Each configuration's TTFT p99 after the capacity change against its own before it (the
    docs' bar: at most 2x), enforce's utilisation after it (at least 80%), and shadow's
    recommendation against the sweep's best fixed cap (within 25%)."""
    for run, label, headline in (
        ("halving_enforce", "--adaptive-limit enforce", True),
        (f"halving_fixed{best_cap}", "the best fixed cap", False),
        ("halving_shadow", "--adaptive-limit shadow", False),
    ):
        change = changes[run]
        before, after, ratio = change["ttft_p99_before_ms"], change["ttft_p99_after_ms"], change["ratio"]
        sitting.figure(
            f"TTFT p99 after the capacity halves, {label}",
            after,
            "ms",
            baseline=("before it", before),
            ratio=ratio,
            bar="ratio <= 2",
            met=None if ratio is None else ratio <= 2,
            headline=headline,
            note=f"medians of {rounds} rounds (the ratio: of each run's own); n {fmt(change['n_before'])} before, "
            f"{fmt(change['n_after'])} after, per run",
        )
        sitting.figure(
            f"completed/s after the capacity halves, {label}",
            change["done_after_rps"],
            "req/s",
            headline=False,
        )
    utilisation = changes["halving_enforce"]["utilisation_after"]
    sitting.figure(
        "engine utilisation after the capacity halves, --adaptive-limit enforce",
        None if utilisation is None else 100 * utilisation,
        "%",
        bar=">= 80%",
        met=None if utilisation is None else utilisation >= 0.8,
    )
    off = None if recommended is None else abs(recommended - best_cap) / best_cap
    sitting.figure(
        "--adaptive-limit shadow's limit before the change",
        recommended,
        "requests",
        baseline=("the sweep's best fixed cap", best_cap),
        bar="within 25%",
        met=None if off is None else off <= 0.25,
    )


def halving_run(bench: Bench, name: str, flags: list[str], plan: list[Arrival]) -> Run:
    """One run across the change: two CPU hogs start `--seconds` in."""
    seconds = bench.args.seconds
    hogs: list[subprocess.Popen[bytes]] = []
    starter = threading.Timer(seconds, lambda: hogs.extend(hog(seconds + 5)))
    starter.start()
    try:
        return bench.open_loop(name, flags, plan)
    finally:
        starter.cancel()
        for p in hogs:
            p.kill()
            p.wait()


def across_the_change(run: Run, seconds: float) -> dict[str, float | None]:
    """One run's figures before the hogs (from a quarter in, the limit settled) and after them (3 s
    after they start)."""
    before, after = run.ttft_ms(0.99, since=seconds / 4, until=seconds), run.ttft_ms(0.99, since=seconds + 3)
    limits_before = [p["adaptive"] for p in run.timeline if seconds / 2 <= p["t"] <= seconds]
    limits_after = [p["adaptive"] for p in run.timeline if p["t"] >= seconds + 5]
    settled = [
        p["t"] - seconds for p in run.timeline if p["t"] >= seconds and p["adaptive"] <= min(limits_after or [0])
    ]
    return {
        "ttft_p99_before_ms": before,
        "ttft_p99_after_ms": after,
        "ratio": after / before if after is not None and before else None,
        "n_before": run.done_count(since=seconds / 4, until=seconds),
        "n_after": run.done_count(since=seconds + 3),
        "utilisation_before": busy_ratio(run, seconds / 4, seconds),
        "utilisation_after": busy_ratio(run, seconds + 3, 2 * seconds),
        "done_rps": run.rps,
        "done_after_rps": run.done_count(since=seconds + 3) / (seconds - 3),
        "limit_before": statistics.median(limits_before) if limits_before else None,
        "limit_after": statistics.median(limits_after) if limits_after else None,
        "settled_s": settled[0] if settled else None,
    }


def adaptive_experiment(bench: Bench, sitting: Sitting) -> str:
    args = bench.args
    capacity = bench.mix_capacity(0.0)
    seconds = args.seconds
    sweep_plan = arrivals(1.5 * capacity, seconds, 0.0, seed=3)
    sweep = [bench.open_loop(f"fixed{c}", ["--max-inflight", str(c)], sweep_plan) for c in (2, 4, 8, 16, 32)]
    top = max(r.rps for r in sweep)
    best = min((r for r in sweep if r.rps >= 0.95 * top), key=lambda r: int(r.name[5:]))
    best_cap = int(best.name[5:])
    plan = arrivals(1.5 * capacity, 2 * seconds, 0.0, seed=4)
    configs = {
        f"halving_fixed{best_cap}": ["--max-inflight", str(best_cap)],
        "halving_enforce": ["--max-inflight", "64", "--adaptive-limit", "enforce"],
        "halving_shadow": ["--max-inflight", str(best_cap), "--adaptive-limit", "shadow"],
    }
    rounds = alternate(
        args.rounds, {name: partial(halving_run, bench, name, flags, plan) for name, flags in configs.items()}
    )
    per_round = [{name: across_the_change(run, seconds) for name, run in r.items()} for r in rounds]
    changes: dict[str, dict[str, float | None]] = {
        name: {key: median(per_round, name, itemgetter(key)) for key in per_round[0][name]} for name in configs
    }
    rows = []
    for name, change in changes.items():
        rows.append(
            [
                name,
                fmt(change["ttft_p99_before_ms"]),
                fmt(change["ttft_p99_after_ms"]),
                fmt(change["ratio"], 2) + "x",
                fmt(change["utilisation_before"], 2),
                fmt(change["utilisation_after"], 2),
                fmt(change["done_rps"], 2),
                f"{fmt(change['limit_before'])} -> {fmt(change['limit_after'])}",
                fmt(change["settled_s"], 1),
            ]
        )
    sweep_rows = [[r.name, f"{r.rps:.2f}", fmt(r.ttft_ms(0.5)), fmt(r.ttft_ms(0.99))] for r in sweep]
    recommended = changes["halving_shadow"]["limit_before"]
    record_adaptive(sitting, changes, best_cap, recommended, args.rounds)
    sitting.details = {
        "arrivals_rps": 1.5 * capacity,
        "capacity_rps": capacity,
        "rounds": args.rounds,
        "sweep": {
            r.name: {"done_rps": r.rps, "ttft_p50_ms": r.ttft_ms(0.5), "ttft_p99_ms": r.ttft_ms(0.99)} for r in sweep
        },
        "best_fixed_cap": best_cap,
        "across_the_change": changes,
        "per_round": per_round,
        "shadow_recommendation": recommended,
    }
    return (
        f"short prompts only, arrivals {1.5 * capacity:.2f}/s (150% of {capacity:.2f}); sweep of fixed caps "
        f"({seconds:g} s each); best = smallest cap within 95% of the top throughput: {best_cap}\n\n"
        + markdown_table(["fixed cap", "done/s", "TTFT p50 ms", "TTFT p99 ms"], sweep_rows)
        + f"\n\nacross the change ({seconds:g} s, then two CPU hogs for {seconds:g} s), medians of {args.rounds} "
        "alternating rounds:\n\n"
        + markdown_table(
            [
                "config",
                "TTFT p99 before ms",
                "after ms",
                "after/before",
                "utilisation before",
                "after",
                "done/s",
                "limit (median) before -> after",
                "limit settled after s",
            ],
            rows,
        )
        + f"\n\nshadow's recommendation before the change: {fmt(recommended)} against the sweep's best {best_cap}"
        f" ({abs((recommended or 0) - best_cap) / best_cap:.0%} apart)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="mix,deadline,adaptive")
    worker_options(parser)
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per run (the adaptive runs: twice)")
    parser.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT SLO of goodput, and the deadline")
    parser.add_argument("--rounds", type=int, default=3, help="deadline, adaptive: alternating rounds")
    args = parser.parse_args()
    chosen = args.experiments.split(",")
    sittings = {part: Sitting(("govwire", "governor", "worker"), part=part) for part in EXPERIMENTS if part in chosen}
    print(f"# experiment 8 on {machine()}, model {args.model}", flush=True)
    bench = Bench(args)
    report = [f"machine: {machine()}; model {args.model}, dtype {args.dtype}\n"]
    try:
        mix_capacity = bench.mix_capacity(0.1) if {"mix", "deadline"} & set(chosen) else 0.0
        if "mix" in chosen:
            report.append("### token budget vs request cap\n\n" + mix_experiment(bench, mix_capacity, sittings["mix"]))
        if "deadline" in chosen:
            report.append("### deadlines\n\n" + deadline_experiment(bench, mix_capacity, sittings["deadline"]))
        if "adaptive" in chosen:
            report.append("### adaptive limit\n\n" + adaptive_experiment(bench, sittings["adaptive"]))
    finally:
        bench.close()
    finish("token_admission", report, sittings.values())


if __name__ == "__main__":
    main()
