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
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import orjson

from benchmarks.harness.common import (
    ROOT,
    free_port,
    machine,
    markdown_table,
    start,
    start_governor,
    stats,
    stop,
    wait_for_port,
    wait_until,
)
from governor.client import NO_RETRY, Client, Yielded
from govwire.codec import encode, generate_frame


def measure(port: int, args: argparse.Namespace) -> dict[str, float]:
    """frames_per_s, rtt_p50_ms and rtt_p99_ms of one client run."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.harness.yield_client",
            "--port",
            str(port),
            "--seconds",
            str(args.seconds),
            "--connections",
            str(args.connections),
            "--window",
            str(args.window),
            "--batch",
            str(args.batch),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = orjson.loads(out.stdout)
    return result


def run_bare(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    proc = start(["-m", "benchmarks.harness.bare_server", str(port)])
    try:
        wait_for_port(port)
        return measure(port, args)
    finally:
        stop(proc)


def yielded_hint(client: Client) -> int:
    """The retry hint of one generate refused while the only slot is held."""
    try:
        client.generate("x")
    except Yielded as exc:
        return exc.retry_hint_ms
    raise AssertionError("admitted while the only slot was held")


def run_governor(args: argparse.Namespace, log: Path, *flags: str) -> tuple[dict[str, float], list[int], float]:
    """Frames/s on the yield path, the retry hints a client sees right after, the service time (ms).
    `flags` set the cap one request fills (default `--max-inflight 1`)."""
    flags = flags or ("--max-inflight", "1")
    proc, port = start_governor(*flags, worker_args=("--token-delay-ms", "1000"), log=log)
    try:
        with Client("127.0.0.1", port) as client:
            for _ in range(20):  # empty prompts end at once (eos): service times get observed
                client.generate("")
        service_time_ms = stats(port)["service_time_ms"]
        assert service_time_ms is not None
        holder = socket.create_connection(("127.0.0.1", port))
        holder.sendall(encode(generate_frame("holder", "x", max_new_tokens=4096, stop_on_eos=False)))
        wait_until(lambda: stats(port)["inflight"] == 1)
        try:
            rate = measure(port, args)
            with Client("127.0.0.1", port, retry=NO_RETRY) as client:
                hints = [yielded_hint(client) for _ in range(5)]
            return rate, hints, service_time_ms
        finally:
            holder.close()
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024, help="frames in flight per connection")
    parser.add_argument("--batch", type=int, default=64, help="frames per write")
    args = parser.parse_args()
    log = ROOT / "benchmarks" / "out" / "yield_governor.log"
    log.parent.mkdir(exist_ok=True)
    bare_runs, gov_runs = [], []
    for i in range(args.repeats):
        bare_runs.append(run_bare(args))
        result, hints, service_time_ms = run_governor(args, log)
        gov_runs.append(result)
        print(
            f"run {i + 1}: bare {bare_runs[-1]['frames_per_s']:,.0f} frames/s, governor {result['frames_per_s']:,.0f}"
            f" frames/s (observed service time {service_time_ms} ms; retry hints right after: {hints} ms)",
            flush=True,
        )
    print(f"\nmachine: {machine()}\n")
    rows = []
    for name, runs in (("bare uvloop+orjson", bare_runs), ("governor (yield path)", gov_runs)):
        rates = [r["frames_per_s"] for r in runs]
        rows.append(
            [
                name,
                f"{statistics.median(rates):,.0f}",
                f"{statistics.median(r['rtt_p50_ms'] for r in runs):.2f}",
                f"{statistics.median(r['rtt_p99_ms'] for r in runs):.2f}",
                ", ".join(f"{x:,.0f}" for x in rates),
            ]
        )
    print(markdown_table(["server", "median frames/s", "RTT p50 (ms)", "RTT p99 (ms)", "runs (frames/s)"], rows))
    bare = [r["frames_per_s"] for r in bare_runs]
    gov = [r["frames_per_s"] for r in gov_runs]
    b, g = statistics.median(bare), statistics.median(gov)
    paired = statistics.median(x / y for x, y in zip(gov, bare, strict=True))
    print(f"\ngovernor / bare: ratio of medians {g / b:.2f}, median of paired ratios {paired:.2f}")


if __name__ == "__main__":
    main()
