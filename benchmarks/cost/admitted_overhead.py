"""Experiment 4b: what the governor adds to an admitted request's latency.

One echo worker (no delays) on a TCP port; a governor linked to it. The same closed-loop workload
runs through the governor and straight to the worker (`governor bench --direct`), alternating, so
both see the same machine noise. The added latency is governor − direct at each percentile of
TTFT and of the whole request, per round; the table shows medians over rounds.

    python -m benchmarks.cost.admitted_overhead [--rounds 5] [--requests 2000]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.harness.common import (
    bench,
    free_port,
    machine,
    markdown_table,
    out_dir,
    start,
    start_governor,
    stop,
    wait_for_port,
)
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order
from governor.bench.stats import Summary

FIGURES: dict[str, Callable[[Summary], float | None]] = {
    "TTFT p50": lambda s: s.ttft_ms.p50,
    "TTFT p99": lambda s: s.ttft_ms.p99,
    "latency p99": lambda s: s.latency_ms.p99,
}


def figure(pick: Callable[[Summary], float | None], summary: Summary) -> float:
    value = pick(summary)
    if value is None:
        raise ValueError("a run completed no request")
    return value


def median(values: list[float | None]) -> float:
    return statistics.median(v for v in values if v is not None)


def record(sitting: Sitting, concurrency: int, runs: dict[str, list[Summary]], diffs: list[list[float]]) -> None:
    """One concurrency's figures: each percentile through the governor beside straight to the worker,
    compared by what the governor adds (the median over rounds of governor − direct per round; the
    issue-15 bar, < 0.5 ms added at p99, is for 16 clients)."""
    clients = f"{concurrency} client{'s' if concurrency != 1 else ''}"
    for (name, pick), per_round in zip(FIGURES.items(), diffs, strict=True):
        added = statistics.median(per_round)
        bar = name == "TTFT p99" and concurrency == 16
        sitting.figure(
            f"{name} through the governor, {clients}",
            median([pick(s) for s in runs["governor"]]),
            "ms",
            baseline=("straight to the worker", median([pick(s) for s in runs["direct"]])),
            difference=added,
            bar="< 0.5 ms added" if bar else None,
            met=added < 0.5 if bar else None,
            headline=name == "TTFT p99",
            note=f"added per round {', '.join(f'{d:+.3f}' for d in per_round)}",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    worker_port = free_port()
    worker_address = f"127.0.0.1:{worker_port}"
    log = out_dir() / "admitted_overhead.log"
    worker = start(["-m", "worker", "serve", "--engine", "echo", "--listen", worker_address, "--log-level", "warning"])
    rows = []
    worst: list[str] = []  # the largest per-round added TTFT p99
    details: dict[str, dict[str, dict[str, list[Any]]]] = {}  # per concurrency, path (and "added"), figure: per round
    try:
        wait_for_port(worker_port)
        governor, port = start_governor("--worker", worker_address, "--max-inflight", "64", log=log)
        try:
            for concurrency in args.concurrency:
                workload = {"num_requests": args.requests, "concurrency": concurrency, "max_new_tokens": 4}
                runs: dict[str, list[Summary]] = {"governor": [], "direct": []}
                for i in range(args.rounds):
                    paths = [("direct", worker_address), ("governor", "")]
                    for name, direct in order(i, paths):
                        print(f"\n### concurrency {concurrency}, {name} (round {i + 1})", flush=True)
                        # stats polled rarely: the direct path has no poller to match
                        summary, _ = bench(
                            f"127.0.0.1:{port}",
                            direct=direct,
                            warmup_runs=int(i == 0),
                            poll_interval_ms=60_000,
                            **workload,
                        )
                        assert summary.requests == args.requests, summary
                        runs[name].append(summary)
                for name, summaries in runs.items():
                    cells = [f"{median([f(s) for s in summaries]):.3f}" for f in FIGURES.values()]
                    rows.append([str(concurrency), name, *cells])
                # governor − direct per round (the two runs of a round share the machine's state), median over rounds
                paired = list(zip(runs["governor"], runs["direct"], strict=True))
                diffs = [[figure(f, g) - figure(f, d) for g, d in paired] for f in FIGURES.values()]
                rows.append([str(concurrency), "**added**", *(f"{statistics.median(d):+.3f}" for d in diffs)])
                worst.append(f"{concurrency} clients: {max(diffs[1]):+.3f} ms")
                record(sitting, concurrency, runs, diffs)
                details[str(concurrency)] = {
                    path: {name: [f(s) for s in summaries] for name, f in FIGURES.items()}
                    for path, summaries in runs.items()
                } | {"added": dict(zip(FIGURES, diffs, strict=True))}
        finally:
            stop(governor)
    finally:
        stop(worker)
    print(f"\nmachine: {machine()}; medians over {args.rounds} rounds of {args.requests} requests\n")
    print(markdown_table(["clients", "path", "TTFT p50 (ms)", "TTFT p99 (ms)", "latency p99 (ms)"], rows))
    print(f"\nlargest added TTFT p99 in a single round: {', '.join(worst)}")
    sitting.details = {"requests_per_round": args.requests, "rounds": details}
    sitting.write()


if __name__ == "__main__":
    main()
