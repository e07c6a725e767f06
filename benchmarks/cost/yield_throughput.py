"""Yield-path throughput: the governor against a bare uvloop+orjson server, same client, same run.

The governor runs with --max-inflight 1. A few requests complete first, so the retry hint runs
its adaptive path (computed from the observed service time); then one long request holds the
slot, and every measured frame goes through the whole yield path (split, parse, envelope check,
duplicate check, admission, retry hint, accounting, decision histogram) and is answered with a
yield. Runs alternate bare/governor to share the machine's noise.

    python -m benchmarks.cost.yield_throughput [--repeats 3] [--seconds 3] [--connections 4]
        [--window 1024] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.harness.common import (
    ROOT,
    free_port,
    machine,
    markdown_table,
    start,
    stop,
    wait_for_port,
)
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order
from benchmarks.harness.yield_path import ndjson_yield_rate, run_governor


def run_bare(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    proc = start(["-m", "benchmarks.harness.bare_server", str(port)])
    try:
        wait_for_port(port)
        return ndjson_yield_rate(port, args)
    finally:
        stop(proc)


def part(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The result file's part: none at the default load, else the load's shape (`c32w64`), so that the
    `--connections 32 --window 64` invocation the docs run beside the default keeps its own file."""
    if all(getattr(args, k) == parser.get_default(k) for k in ("connections", "window", "batch")):
        return None
    batch = f"b{args.batch}" if args.batch != parser.get_default("batch") else ""
    return f"c{args.connections}w{args.window}{batch}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024, help="frames in flight per connection")
    parser.add_argument("--batch", type=int, default=64, help="frames per write")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"), part=part(parser, args))
    log = ROOT / "benchmarks" / "out" / "yield_governor.log"
    log.parent.mkdir(exist_ok=True)
    bare_runs, gov_runs = [], []
    after: list[dict[str, float | list[int]]] = []  # per run: the observed service time and the hints right after
    for i in range(args.repeats):
        for side in order(i, ("bare", "governor")):  # alternating, so a drift falls on both sides alike
            if side == "bare":
                bare_runs.append(run_bare(args))
                continue
            result, hints, service_time_ms = run_governor(args, log)
            gov_runs.append(result)
            after.append({"service_time_ms": service_time_ms, "retry_hints_ms": hints})
        print(
            f"run {i + 1}: bare {bare_runs[-1]['frames_per_s']:,.0f} frames/s, governor {result['frames_per_s']:,.0f}"
            f" frames/s (observed service time {service_time_ms} ms; retry hints right after: {hints} ms)",
            flush=True,
        )
    print(f"\nmachine: {machine()}\n")
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for name, runs in (("bare uvloop+orjson", bare_runs), ("governor (yield path)", gov_runs)):
        rates = [r["frames_per_s"] for r in runs]
        medians[name] = {key: statistics.median(r[key] for r in runs) for key in ("rtt_p50_ms", "rtt_p99_ms")}
        rows.append(
            [
                name,
                f"{statistics.median(rates):,.0f}",
                f"{medians[name]['rtt_p50_ms']:.2f}",
                f"{medians[name]['rtt_p99_ms']:.2f}",
                ", ".join(f"{x:,.0f}" for x in rates),
            ]
        )
    print(markdown_table(["server", "median frames/s", "RTT p50 (ms)", "RTT p99 (ms)", "runs (frames/s)"], rows))
    bare = [r["frames_per_s"] for r in bare_runs]
    gov = [r["frames_per_s"] for r in gov_runs]
    b, g = statistics.median(bare), statistics.median(gov)
    paired = statistics.median(x / y for x, y in zip(gov, bare, strict=True))
    print(f"\ngovernor / bare: ratio of medians {g / b:.2f}, median of paired ratios {paired:.2f}")

    load = f"{args.connections} connections × {args.window:,} in flight"
    bare_name = "bare uvloop+orjson server"
    sitting.figure(
        f"yield path frames/s, {load}",
        g,
        "frames/s",
        baseline=(bare_name, b),
        ratio=paired,
        bar=">= 0.9x",
        met=paired >= 0.9,
        note=f"ratio: the median of paired ratios (the ratio of medians is {g / b:.2f})",
    )
    for pct in ("p50", "p99"):
        key = f"rtt_{pct}_ms"
        governor_rtt, bare_rtt = medians["governor (yield path)"][key], medians["bare uvloop+orjson"][key]
        sitting.figure(
            f"yield reply RTT {pct}, {load}", governor_rtt, "ms", baseline=(bare_name, bare_rtt), headline=False
        )
    sitting.details = {
        "load": {"connections": args.connections, "window": args.window, "batch": args.batch, "seconds": args.seconds},
        "bare_runs": bare_runs,
        "governor_runs": gov_runs,
        "governor_runs_after": after,
    }
    sitting.write()


if __name__ == "__main__":
    main()
