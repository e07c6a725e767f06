"""Experiment 1: bounded inflight under a burst.

A burst of prefill-heavy requests (long prompts, one new token, all submitted at once) against the
GPT-2 worker (random weights), once with no cap in practice and once with `--max-inflight CAP`.
Without a cap every request queues inside the worker and the last ones wait for all the others'
prefill; with it, the excess is yielded at once and the admitted ones see a short queue. The
worker's throughput should not change: it is busy either way. Throughput is shown over the run's
wall (client: first submission to last reply) and as the worker's prompt tokens per busy second
(its pushed engine statistics), which leaves out the client's window.

    python -m benchmarks.admission.burst [--requests 256] [--prompt-repeats 26] [--cap 64] [--repeats 1]
"""

from __future__ import annotations

import argparse
import time

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
from governor.bench.plot import write_plot
from governor.bench.runner import RunResult
from governor.bench.stats import Summary


def engine_totals(port: int) -> dict[str, float]:
    return dict(stats(port)["workers"][0]["engine"])


def run_one(cap: int, args: argparse.Namespace) -> tuple[Summary, RunResult, float]:
    """The run, and the worker's prompt tokens per busy second during it (from its pushed stats)."""
    worker = ("--engine", "gpt2", "--model", args.model, "--threads", str(args.threads), "--stats-interval-s", "0.1")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-repeats", type=int, default=26, help="'Hello' repeated: 5 tokens each (bytes)")
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    rows, curves = [], []
    for i in range(args.repeats):
        for name, cap in (("unlimited", UNLIMITED), (f"--max-inflight {args.cap}", args.cap)):
            print(f"\n### {name} (repeat {i + 1})", flush=True)
            summary, result, busy_rate = run_one(cap, args)
            curves.append((name, result))
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


if __name__ == "__main__":
    main()
