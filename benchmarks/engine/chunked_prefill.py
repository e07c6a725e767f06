"""Stall-free chunked prefill: running streams and short requests while long prompts arrive.

    python -m benchmarks.engine.chunked_prefill [--rounds 2] [--budgets 2048,0,64] [--seconds 20]

A governor in front of a GPT-2 worker (random weights, CPU), once per prompt budget
(`--max-prefill-tokens`): 2048 prefills each 896-token prompt in one step; 0, the default, takes
2048 while nothing decodes and beside running decodes the budget the CPU engine learns from its
steps (worker/prefill_budget.py); 64 holds every step to 64 prompt tokens (the CPU's default
before issue 46). The same workload for each, two
`governor bench` runs at once on their own connections: short requests (32-token prompts, 32 new
tokens, Poisson every --short-interval-ms) and long ones (896-token prompts, 8 new tokens, every
--long-interval-ms). Per budget: the short streams' ITL p50 / p99 / p99.9 / max (the running
streams while long prompts come in), short-request TTFT p50 / p99, long-request TTFT p50, completion tokens/s of both
together. Rounds alternate the order of the budgets; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from benchmarks.harness import rounds
from benchmarks.harness.common import machine, markdown_table, start_governor, stop
from benchmarks.harness.results import Sitting
from governor.bench.config import BenchConfig
from governor.bench.main import measure
from governor.bench.stats import Summary, percentile

SHORT_PROMPT, SHORT_NEW = 32, 32
LONG_PROMPT, LONG_NEW = 896, 8


async def workload(address: str, a: argparse.Namespace) -> tuple[Summary, Summary, list[float]]:
    def config(prompt: int, new: int, interval_ms: float, schedule: str, seed: int) -> BenchConfig:
        return BenchConfig(
            address=address,
            num_requests=max(1, int(a.seconds * 1000 / interval_ms)),
            prompt_len_dist=f"fixed:{prompt}",
            max_new_tokens=new,
            stop_on_eos=False,
            submit_interval_ms=interval_ms,
            submit_schedule=schedule,  # type: ignore[arg-type]
            seed=seed,
            timeout_s=600,
        )

    short = config(SHORT_PROMPT, SHORT_NEW, a.short_interval_ms, "poisson", 1)
    long = config(LONG_PROMPT, LONG_NEW, a.long_interval_ms, "absolute", 2)
    (s_runs, l_runs) = await asyncio.gather(measure(short), measure(long))
    (s_summary, s_result), (l_summary, _) = s_runs[-1], l_runs[-1]
    gaps = [
        (t1 - t0) * 1000 for x in s_result.samples for t0, t1 in zip(x.token_times, x.token_times[1:], strict=False)
    ]
    return s_summary, l_summary, sorted(gaps)


def one(budget: int, a: argparse.Namespace) -> dict[str, Any]:
    worker = ("--engine", "gpt2", "--threads", str(a.threads), "--dtype", a.dtype, "--max-prefill-tokens", str(budget))
    gov, port = start_governor("--max-inflight", "256", worker_args=worker, timeout=300)
    try:
        short, long, itl = asyncio.run(workload(f"127.0.0.1:{port}", a))
    finally:
        stop(gov)
    wall = max(short.wall_s, long.wall_s)
    row = {
        "budget": budget,
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "itl_p999": percentile(itl, 99.9),
        "itl_max": itl[-1],
        "short_ttft_p50": short.ttft_ms.p50,
        "short_ttft_p99": short.ttft_ms.p99,
        "long_ttft_p50": long.ttft_ms.p50,
        "tok_s": (short.completion_tokens + long.completion_tokens) / wall,
        "done": (short.requests, long.requests),
    }
    print(
        f"budget {budget:5d}: ITL p50 {row['itl_p50']:.0f} / p99 {row['itl_p99']:.0f} / p99.9"
        f" {row['itl_p999']:.0f} / max {row['itl_max']:.0f} ms, short TTFT p50"
        f" {row['short_ttft_p50']:.0f} / p99 {row['short_ttft_p99']:.0f} ms, long TTFT p50"
        f" {row['long_ttft_p50']:.0f} ms, {row['tok_s']:.1f} completion tok/s, done {row['done']}",
        flush=True,
    )
    return row


KEYS = ("itl_p50", "itl_p99", "itl_p999", "itl_max", "short_ttft_p50", "short_ttft_p99", "long_ttft_p50", "tok_s")
# The targets for a chunked budget against one-step prefill (docs/benchmarks/sittings.md, 5): short
# TTFT p99 cut >= 2x, completion tokens/s within 5%, ITL p99 <= 2x its own median.
TTFT_CUT, TOK_S_SPREAD, ITL_SPREAD = 2.0, 0.05, 2.0


def label(budget: int) -> str:
    return "learned (the default)" if budget == 0 else f"{budget} tokens"


def record(sitting: Sitting, medians: dict[int, dict[str, float]]) -> None:
    """Every budget after the first against the first (the one-step prefill by default), medians over
    rounds as the table prints them; the short requests' TTFT p99 and the streams' ITL p99 are the
    headline."""
    base, *others = medians
    baseline = f"budget {label(base)}"
    for budget in others:
        m, b = medians[budget], medians[base]
        sitting.figure(
            f"short TTFT p99, budget {label(budget)}",
            m["short_ttft_p99"],
            "ms",
            baseline=(baseline, b["short_ttft_p99"]),
            bar=f"<= {1 / TTFT_CUT:g}x ({TTFT_CUT:g}x lower)",
            met=b["short_ttft_p99"] / m["short_ttft_p99"] >= TTFT_CUT,
        )
        sitting.figure(
            f"short streams' ITL p99, budget {label(budget)}", m["itl_p99"], "ms", baseline=(baseline, b["itl_p99"])
        )
        sitting.figure(
            f"completion tok/s, budget {label(budget)}",
            m["tok_s"],
            "tok/s",
            baseline=(baseline, b["tok_s"]),
            bar=f"within {TOK_S_SPREAD:.0%}",
            met=abs(m["tok_s"] / b["tok_s"] - 1) <= TOK_S_SPREAD,
            headline=False,
        )
        sitting.figure(
            f"long TTFT p50, budget {label(budget)}",
            m["long_ttft_p50"],
            "ms",
            baseline=(baseline, b["long_ttft_p50"]),
            headline=False,
        )
    for budget, m in medians.items():  # the one-step budget's spread is there to compare by eye
        spread, chunked = m["itl_p99"] / m["itl_p50"], budget != base
        sitting.figure(
            f"ITL p99 over p50, budget {label(budget)}",
            spread,
            "x",
            bar=f"<= {ITL_SPREAD:g}x" if chunked else None,
            met=spread <= ITL_SPREAD if chunked else None,
            headline=False,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--budgets", default="2048,0,64", help="--max-prefill-tokens values, compared (0: the default, learned)"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0, help="length of each run's submissions")
    p.add_argument("--short-interval-ms", type=float, default=200.0)
    p.add_argument("--long-interval-ms", type=float, default=1500.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    sitting = Sitting(("govwire", "governor", "worker"))
    budgets = [int(b) for b in a.budgets.split(",")]
    print(f"machine: {machine()}")
    rows: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
    for r in range(a.rounds):
        for budget in rounds.order(r, budgets):
            rows[budget].append(one(budget, a))
    medians = {b: {k: statistics.median(x[k] for x in rows[b]) for k in KEYS} for b in budgets}
    table = [[str(b), *(f"{medians[b][k]:,.1f}" for k in KEYS)] for b in budgets]
    print()
    print(
        markdown_table(
            [
                "budget",
                "ITL p50 ms",
                "ITL p99",
                "ITL p99.9",
                "ITL max",
                "short TTFT p50",
                "short TTFT p99",
                "long TTFT p50",
                "tok/s",
            ],
            table,
        )
    )
    record(sitting, medians)
    sitting.details = {"medians": medians, "rounds": rows}
    sitting.write()


if __name__ == "__main__":
    main()
