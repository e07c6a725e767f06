"""Experiment 1: bounded inflight under a burst.

A burst of prefill-heavy requests (long prompts, one new token, all submitted at once) against the
GPT-2 worker (random weights), once with no cap in practice and once with `--max-inflight CAP`.
Without a cap every request queues inside the worker and the last ones wait for all the others'
prefill; with it, the excess is yielded at once and the admitted ones see a short queue. The
worker's throughput should not change: it is busy either way. Throughput is shown over the run's
wall (client: first submission to last reply) and as the worker's prompt tokens per busy second
(its pushed engine statistics), which leaves out the client's window. The prompts are all alike,
so the worker runs without its prefix cache: with it, every prompt after the first would be a cache
hit and the burst no prefill at all (the experiment predates the cache).

Beside p50/p99, each run keeps its admitted requests' TTFT at every percentile from 0 (the first
reply) to 100 (the last), linearly interpolated: enough for the figures page to draw both runs'
distributions from the result file alone (the per-request samples stay in benchmarks/out/).

    python -m benchmarks.admission.burst [--requests 256] [--prompt-repeats 26] [--cap 64] [--repeats 1]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.harness import rounds
from benchmarks.harness.common import (
    UNLIMITED,
    bench,
    machine,
    markdown_table,
    ms,
    out_dir,
    server_p99,
    start_governor,
    stats,
    stop,
)
from benchmarks.harness.results import Sitting
from governor.bench.plot import write_plot
from governor.bench.runner import RunResult
from governor.bench.stats import Summary, percentile


def engine_totals(port: int) -> dict[str, float]:
    return dict(stats(port)["workers"][0]["engine"])


def run_one(cap: int, args: argparse.Namespace) -> tuple[Summary, RunResult, float]:
    """The run, and the worker's prompt tokens per busy second during it (from its pushed stats)."""
    worker = (
        "--engine", "gpt2", "--model", args.model, "--threads", str(args.threads), "--stats-interval-s", "0.1",
        "--no-prefix-caching",  # every prompt is the same: cached, the burst would be no prefill at all
    )  # fmt: skip
    proc, port = start_governor(
        "--max-inflight", str(cap), worker_args=worker, log=out_dir() / "burst_governor.log", timeout=180
    )
    try:
        address = f"127.0.0.1:{port}"
        workload = {"prompt": "Hello", "prompt_repeats": args.prompt_repeats, "max_new_tokens": 1, "stop_on_eos": False}
        bench(address, num_requests=32, **workload)  # warm-up: full prefill steps of the measured shape
        time.sleep(0.3)
        before = engine_totals(port)
        summary, result = bench(address, num_requests=args.requests, poll_interval_ms=20, **workload)
        time.sleep(0.3)
        after = engine_totals(port)
        busy = after["busy_seconds_total"] - before["busy_seconds_total"]
        return summary, result, (after["prefill_tokens_total"] - before["prefill_tokens_total"]) / busy
    finally:
        stop(proc)


Run = dict[str, Any]  # one configuration's figures in one pair: numbers, and the TTFT quantiles


def ttft_quantiles_ms(result: RunResult) -> list[float | None]:
    """The completed requests' TTFT at percentiles 0, 1, ..., 100 (ms, to the microsecond): the
    run's distribution in 101 numbers: what a plot of it needs, small enough for the result file
    (the samples, every token's timestamp, stay in benchmarks/out/)."""
    ttfts = [t * 1000 for s in result.samples if (t := s.ttft) is not None]
    return [None if (v := percentile(ttfts, q)) is None else round(v, 3) for q in range(101)]


def figures(summary: Summary, result: RunResult, busy_rate: float) -> Run:
    """The table's columns as numbers, and the TTFT quantiles, for the result file."""
    return {
        "accepted": summary.requests,
        "yielded": summary.yielded,
        "ttft_p50_ms": summary.ttft_ms.p50,
        "ttft_p99_ms": summary.ttft_ms.p99,
        "queue_wait_p99_ms": server_p99(result, "queue_wait_ms"),
        "completion_tok_s": summary.output_tok_s,
        "total_tok_s": summary.total_tok_s,
        "busy_prompt_tok_s": busy_rate,
        "ttft_quantiles_ms": ttft_quantiles_ms(result),
    }


def record(sitting: Sitting, pairs: list[dict[str, Run]], capped: str, requests: int) -> None:
    """The capped runs against the unlimited ones: medians over pairs, each ratio the median of the
    pairs' own ratios (what moved a whole pair cancels)."""

    def add(name: str, key: str, unit: str, *, headline: bool = False, bar: float | None = None) -> None:
        ratio = rounds.paired_ratio(pairs, capped, "unlimited", lambda run: run[key])
        sitting.figure(
            f"{name}, burst of {requests}, {capped}",
            rounds.median(pairs, capped, lambda run: run[key]),
            unit,
            baseline=("unlimited", rounds.median(pairs, "unlimited", lambda run: run[key])),
            ratio=ratio,
            bar=None if bar is None else f"ratio <= {bar:.2f} (cut >= {1 / bar:g}x)",
            met=None if bar is None or ratio is None else ratio <= bar,
            headline=headline,
        )

    add("TTFT p99", "ttft_p99_ms", "ms", headline=True, bar=1 / 3)  # the docs' bar: p99 cut >= 3x
    add("worker prompt tokens per busy second", "busy_prompt_tok_s", "tok/s", headline=True)
    add("TTFT p50", "ttft_p50_ms", "ms")
    add("queue wait p99", "queue_wait_p99_ms", "ms")
    add("total tok/s over the run's wall", "total_tok_s", "tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-repeats", type=int, default=26, help="'Hello' repeated: 5 tokens each (bytes)")
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor", "worker"))
    rows, curves = [], []
    pairs: list[dict[str, Run]] = []
    for i in range(args.repeats):
        pairs.append({})
        for name, cap in (("unlimited", UNLIMITED), (f"--max-inflight {args.cap}", args.cap)):
            print(f"\n### {name} (repeat {i + 1})", flush=True)
            summary, result, busy_rate = run_one(cap, args)
            curves.append((name, result))
            pairs[-1][name] = figures(summary, result, busy_rate)
            rows.append(
                [
                    name,
                    str(summary.requests),
                    str(summary.yielded),
                    ms(summary.ttft_ms.p50),
                    ms(summary.ttft_ms.p99),
                    ms(server_p99(result, "queue_wait_ms")),
                    f"{summary.output_tok_s:.2f}",
                    f"{summary.total_tok_s:,.0f}",
                    f"{busy_rate:,.0f}",
                ]
            )
    headers = ["config", "accepted", "yielded", "TTFT p50 (ms)", "TTFT p99 (ms)", "queue wait p99 (ms)"]
    headers += ["completion tok/s", "total tok/s", "worker prompt tok per busy s"]
    print(f"\nmachine: {machine()}\n")
    print(markdown_table(headers, rows))
    plot = out_dir() / "burst.png"
    write_plot(plot, curves[-2:])
    print(f"\nplot: {plot}")
    record(sitting, pairs, f"--max-inflight {args.cap}", args.requests)
    sitting.details = {"pairs": pairs}
    sitting.write()


if __name__ == "__main__":
    main()
