"""Experiment 10: fleet caps shared through Redis (--fleet), against per-replica caps.

1. **Skewed load.** Three governor replicas, each with its own echo worker (5 tokens, 25 ms apart:
   about 105 ms a request, so that 32 in flight is about 300 a second and both caps bind at once),
   fleet caps of 32 in flight and 300 admissions/s, and closed-loop `governor bench` clients
   (retrying yields after their hint) spread 70/20/10 over the replicas at twice the caps. Every
   replica's stats are read at once every 10 ms: the fleet's in-flight requests (peak and mean
   against the cap), its admissions per second, each replica's yields. The same run with
   per-replica caps only (the cap split evenly: what a fleet without --fleet must do to keep the
   total) for comparison; and the Redis commands per admitted request (`INFO commandstats`).
2. **Yield path.** One replica, frames refused by its own `--max-inflight 1` without and with
   --fleet, and frames refused by its share of a fleet cap of 1 (benchmarks/cost/yield_throughput.py,
   alternating, same client): each against the first in the same round.
3. **Admitted path.** One replica with an echo worker: closed-loop requests with --fleet (a cap
   never reached) and without, alternating: the added TTFT and latency per round.
4. **A replica killed.** Two replicas, the load on the first, which takes the whole cap; SIGKILL
   it while the second is loaded too: the time until the second's share is 90% of the cap. Redis
   keeps a lapsed replica's share reserved while it might still serve (its lease and a half, its
   `--fleet-hold-s`, its `--fleet-max-request-s`: here 0.5 s and 1 s, for requests of ~105 ms).

    python -m benchmarks.admission.fleet [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from subprocess import Popen
from typing import Any

from benchmarks.harness.common import (
    ROOT,
    bench,
    free_port,
    machine,
    markdown_table,
    out_dir,
    start,
    start_governor,
    stats,
    stop,
    wait_for_port,
    wait_until,
)
from benchmarks.harness.fixtures.redis_server import RedisServer
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order
from benchmarks.harness.yield_path import run_governor

CAP, QPS = 32, 300.0
KILL_TAIL = ("--fleet-hold-s", "0.5", "--fleet-max-request-s", "1")
SKEW = (0.7, 0.2, 0.1)
CLIENTS = 2 * CAP  # closed-loop clients: twice the concurrency cap (and, at ~105 ms a request, twice the rate)


def fleet_flags(url: str) -> tuple[str, ...]:
    return ("--fleet", url, "--fleet-max-inflight", str(CAP), "--fleet-max-qps", str(QPS))


def start_replicas(per_replica: list[tuple[str, ...]], log_name: str) -> tuple[list[Popen], list[int]]:
    """A governor per entry of `per_replica` (its flags), each with its own echo worker."""
    procs, ports = [], []
    for i, flags in enumerate(per_replica):
        worker_port = free_port()
        worker = start(
            [
                "-m",
                "worker",
                "serve",
                "--engine",
                "echo",
                "--token-delay-ms",
                "25",
                "--listen",
                f"127.0.0.1:{worker_port}",
            ]
        )
        procs.append(worker)
        wait_for_port(worker_port)
        governor, port = start_governor(
            "--worker", f"127.0.0.1:{worker_port}", *flags, log=out_dir() / f"{log_name}-{i}.log"
        )
        procs.append(governor)
        ports.append(port)
    return procs, ports


def load(port: int, clients: int, seconds: float) -> Popen:
    """`governor bench` closed loop with retries, as a user would drive a replica."""
    argv = [
        sys.executable,
        "-m",
        "governor",
        "bench",
        "--address",
        f"127.0.0.1:{port}",
        "--num-requests",
        str(int(clients * seconds * 20)),  # more than it can finish: it is stopped after the window
        "--concurrency",
        str(clients),
        "--max-new-tokens",
        "5",
        "--no-stop-on-eos",
        "--retry",
        "--max-retries",
        "1000",
        "--timeout-s",
        str(seconds * 4),
        "--poll-interval-ms",
        "60000",
    ]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def admitted(s: dict[str, Any]) -> int:
    return sum(c["admitted_total"] for c in s["classes"].values())


def skewed_run(
    per_replica: list[tuple[str, ...]], seconds: float, redis: RedisServer | None, name: str
) -> tuple[list[str], dict[str, Any]]:
    """The table's row, and its figures as numbers."""
    procs, ports = start_replicas(per_replica, f"fleet-{name}")
    loads: list[Popen] = []
    try:
        if redis is not None:
            wait_until(lambda: all(stats(p)["fleet"]["replicas"] == len(ports) for p in ports), 10)
        counts = [max(1, round(CLIENTS * share)) for share in SKEW]
        loads = [load(port, n, seconds) for port, n in zip(ports, counts, strict=True)]
        time.sleep(2.0)  # ramp: clients connected, shares settled
        calls0 = redis.evalsha_calls() if redis is not None else 0
        samples: list[tuple[float, list[dict[str, Any]]]] = []
        end = time.monotonic() + seconds
        with ThreadPoolExecutor(len(ports)) as pool:
            while time.monotonic() < end:
                samples.append((time.monotonic(), list(pool.map(stats, ports))))
                time.sleep(0.01)
        calls = (redis.evalsha_calls() - calls0) if redis is not None else 0
    finally:
        for proc in loads + procs:
            stop(proc)
    inflight = [sum(s["inflight"] for s in snapshot) for _, snapshot in samples]
    (t0, first), (t1, last) = samples[0], samples[-1]
    admitted_by = [admitted(b) - admitted(a) for a, b in zip(first, last, strict=True)]
    yielded_by = [b["yielded_total"] - a["yielded_total"] for a, b in zip(first, last, strict=True)]
    span = t1 - t0
    qps = sum(admitted_by) / span
    shares = "/".join(f"{n / sum(admitted_by):.0%}" for n in admitted_by)
    yields = "/".join(f"{y / (y + a):.0%}" for y, a in zip(yielded_by, admitted_by, strict=True))
    per_request = f"{calls / sum(admitted_by):.3f}" if redis is not None else "–"
    row = [
        name,
        str(max(inflight)),
        f"{statistics.mean(inflight) / CAP:.1%}",
        f"{qps:.1f} ({qps / QPS:.1%})",
        shares,
        yields,
        per_request,
    ]
    return row, {
        "peak_inflight": max(inflight),
        "mean_use_of_cap": statistics.mean(inflight) / CAP,
        "admitted_per_s": qps,
        "admitted_by_replica": admitted_by,
        "yielded_by_replica": yielded_by,
        "redis_commands_per_request": calls / sum(admitted_by) if redis is not None else None,
    }


def yield_path(rounds: int, url: str) -> tuple[list[list[str]], dict[str, list[float]], dict[str, float]]:
    """The table's rows, each configuration's frames/s per round, and its ratio to the baseline."""
    args = argparse.Namespace(seconds=3.0, connections=4, window=1024, batch=64)
    log = out_dir() / "fleet-yield.log"
    flags = {
        "its own --max-inflight 1, no --fleet": ("--max-inflight", "1"),
        "its own --max-inflight 1, with --fleet": ("--max-inflight", "1", "--fleet", url, "--fleet-max-inflight", "64"),
        "its share of --fleet-max-inflight 1": ("--max-inflight", "64", "--fleet", url, "--fleet-max-inflight", "1"),
    }
    runs: dict[str, list[float]] = {name: [] for name in flags}
    for i in range(rounds):
        for name in order(i, list(flags)):  # alternating: the same machine noise
            result, _, _ = run_governor(args, log, *flags[name])
            runs[name].append(result["frames_per_s"])
            print(f"yield path, {name}: {result['frames_per_s']:,.0f} frames/s", flush=True)
    base = runs["its own --max-inflight 1, no --fleet"]
    # the ratio: to the baseline of the same round (they share the machine's state), median over rounds
    ratios = {name: statistics.median(r / b for r, b in zip(rates, base, strict=True)) for name, rates in runs.items()}
    rows = [
        [
            name,
            f"{statistics.median(rates):,.0f}",
            f"{ratios[name]:.3f}",
            ", ".join(f"{r:,.0f}" for r in rates),
        ]
        for name, rates in runs.items()
    ]
    return rows, runs, ratios


def admitted_path(rounds: int, redis: RedisServer) -> tuple[list[list[str]], dict[str, float]]:
    """The table's rows, and what --fleet added (medians of the per-round differences)."""
    worker_port = free_port()
    worker = start(["-m", "worker", "serve", "--engine", "echo", "--listen", f"127.0.0.1:{worker_port}"])
    rows: list[list[str]] = []
    try:
        wait_for_port(worker_port)
        plain, plain_port = start_governor("--worker", f"127.0.0.1:{worker_port}", "--max-inflight", "64")
        fleet, fleet_port = start_governor(  # fleet caps it never reaches: what the lease costs a request
            "--worker",
            f"127.0.0.1:{worker_port}",
            "--max-inflight",
            "64",
            *("--fleet", redis.url, "--fleet-max-inflight", "1000", "--fleet-max-qps", "1000000"),
        )
        try:
            runs: dict[str, list[Any]] = {"without --fleet": [], "with --fleet": []}
            calls: list[float] = []
            for i in range(rounds):
                paths = [("without --fleet", plain_port), ("with --fleet", fleet_port)]
                for name, port in order(i, paths):
                    before = redis.evalsha_calls()
                    summary, _ = bench(
                        f"127.0.0.1:{port}",
                        num_requests=2000,
                        concurrency=16,
                        max_new_tokens=4,
                        warmup_runs=int(i == 0),
                        poll_interval_ms=60_000,
                    )
                    runs[name].append(summary)
                    if name == "with --fleet":
                        calls.append((redis.evalsha_calls() - before) / summary.requests)
            for name, summaries in runs.items():
                rows.append(
                    [
                        name,
                        f"{statistics.median(s.ttft_ms.p50 for s in summaries):.3f}",
                        f"{statistics.median(s.ttft_ms.p99 for s in summaries):.3f}",
                        f"{statistics.median(s.latency_ms.p99 for s in summaries):.3f}",
                        f"{statistics.median(s.executed_rps for s in summaries):,.0f}",
                    ]
                )
            paired = list(zip(runs["with --fleet"], runs["without --fleet"], strict=True))
            added: dict[str, float] = {
                key: statistics.median(pick(w) - pick(o) for w, o in paired)
                for key, pick in (
                    ("ttft_p50_ms", lambda s: s.ttft_ms.p50),
                    ("ttft_p99_ms", lambda s: s.ttft_ms.p99),
                    ("latency_p99_ms", lambda s: s.latency_ms.p99),
                )
            }
            added["requests_per_s_ratio"] = statistics.median(w.executed_rps / o.executed_rps for w, o in paired)
            added["redis_commands_per_request"] = max(calls)
            rows.append(
                [
                    "**added** (per round, median)",
                    *(f"{added[key]:+.3f}" for key in ("ttft_p50_ms", "ttft_p99_ms", "latency_p99_ms")),
                    f"{added['requests_per_s_ratio']:.3f}x",
                ]
            )
            rows.append(["Redis commands per admitted request (with --fleet)", f"{max(calls):.4f}", "", "", ""])
        finally:
            stop(plain)
            stop(fleet)
    finally:
        stop(worker)
    return rows, added


def inflight_share(port: int) -> float:
    return float(stats(port)["fleet"]["resources"]["inflight"]["share"])


def killed_replica(redis: RedisServer) -> tuple[float, float]:
    """Seconds until the survivor's share was back at 90% of the cap, and its share before."""
    flags = ("--max-inflight", "64", "--fleet", redis.url, "--fleet-max-inflight", str(CAP), *KILL_TAIL)
    procs, ports = start_replicas([flags] * 2, "fleet-kill")
    first, second = ports
    loads: list[Popen] = []
    try:
        wait_until(lambda: all(stats(p)["fleet"]["replicas"] == 2 for p in ports), 10)
        loads.append(load(first, CLIENTS, 20))
        wait_until(lambda: inflight_share(first) >= 0.9 * CAP, 10)
        loads.append(load(second, CLIENTS, 20))
        time.sleep(1.0)  # both loaded: the cap is split between them
        before = inflight_share(second)
        governor_of_first = procs[1]
        os.kill(governor_of_first.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: inflight_share(second) >= 0.9 * CAP, 10)
        back = time.monotonic() - killed
    finally:
        for proc in loads + procs:
            stop(proc)
    return back, before


def record(
    sitting: Sitting,
    fleet: dict[str, Any],
    split: dict[str, Any],
    yield_runs: dict[str, list[float]],
    yield_ratios: dict[str, float],
    added: dict[str, float],
    back: float,
) -> None:
    """The bars are the docs': peak <= the cap, mean use >= 90%, admissions within 5% of the cap,
    the yield path >= 0.95x."""
    split_name = "per-replica caps, split evenly"
    sitting.figure(
        f"mean use of the fleet's in-flight cap of {CAP}, skewed load", 100 * fleet["mean_use_of_cap"], "%",
        baseline=(split_name, 100 * split["mean_use_of_cap"]), bar=">= 90%", met=fleet["mean_use_of_cap"] >= 0.9,
    )  # fmt: skip
    sitting.figure(
        f"admitted/s under a fleet cap of {QPS:g}/s, skewed load", fleet["admitted_per_s"], "req/s",
        baseline=(split_name, split["admitted_per_s"]), bar=f"within 5% of {QPS:g}",
        met=abs(fleet["admitted_per_s"] / QPS - 1) <= 0.05,
    )  # fmt: skip
    sitting.figure(
        f"peak in flight under a fleet cap of {CAP}, skewed load", fleet["peak_inflight"], "requests",
        baseline=(split_name, split["peak_inflight"]), bar=f"<= {CAP}", met=fleet["peak_inflight"] <= CAP,
        headline=False,
    )  # fmt: skip
    base = "its own --max-inflight 1, no --fleet"
    for name, headline in (
        ("its share of --fleet-max-inflight 1", True),
        ("its own --max-inflight 1, with --fleet", False),
    ):
        sitting.figure(
            f"yield path, refused by {name}", statistics.median(yield_runs[name]), "frames/s",
            baseline=("own --max-inflight 1, no --fleet", statistics.median(yield_runs[base])),
            ratio=yield_ratios[name], bar="ratio >= 0.95", met=yield_ratios[name] >= 0.95, headline=headline,
        )  # fmt: skip
    sitting.figure("TTFT p99 added by --fleet, admitted path", added["ttft_p99_ms"], "ms", headline=False)
    for load, per_request in (
        ("skewed load", fleet["redis_commands_per_request"]),
        ("admitted path", added["redis_commands_per_request"]),
    ):
        sitting.figure(f"Redis commands per admitted request, {load}", per_request, "commands", headline=False)
    sitting.figure(
        "survivor back at 90% of the cap after a replica is killed (reserved: lease x1.5, hold 0.5 s, request 1 s)",
        1000 * back, "ms", bar="<= 3500 ms (reserved 3 s + 2 periods)", met=back <= 3.5,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window of each skewed run")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of the yield and admitted paths")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    with RedisServer() as redis:
        split = [("--max-inflight", str(CAP // 3 + (i < CAP % 3)), "--max-qps", f"{QPS / 3:g}") for i in range(3)]
        fleet_row, fleet = skewed_run(
            [("--max-inflight", "64", *fleet_flags(redis.url))] * 3, args.seconds, redis, "--fleet"
        )
        split_row, split_caps = skewed_run(split, args.seconds, None, "per-replica caps (split evenly)")
        skew = [fleet_row, split_row]
        yields, yield_runs, yield_ratios = yield_path(args.rounds, redis.url)
        admitted_rows, added = admitted_path(args.rounds, redis)
        back, share_before = killed_replica(redis)
    print(f"\nmachine: {machine()}\n")
    print(f"fleet caps {CAP} in flight, {QPS:g}/s; {CLIENTS} clients {'/'.join(f'{s:.0%}' for s in SKEW)}:\n")
    headers = [
        "caps",
        "peak in flight",
        "mean use of the cap",
        "admitted/s",
        "admitted by replica",
        "yields by replica",
        "Redis cmds / request",
    ]
    print(markdown_table(headers, skew))
    print("\nyield path (frames/s; medians over rounds):\n")
    print(markdown_table(["refused by", "frames/s", "ratio", "runs"], yields))
    print("\nadmitted path (16 clients, 4-token echo requests; medians over rounds):\n")
    print(
        markdown_table(["governor", "TTFT p50 (ms)", "TTFT p99 (ms)", "latency p99 (ms)", "requests/s"], admitted_rows)
    )
    print(
        "\nthe survivor's share reached 90% of the cap after the other replica's SIGKILL: "
        f"{back * 1000:.0f} ms (its share before: {share_before:g} of {CAP})"
    )
    record(sitting, fleet, split_caps, yield_runs, yield_ratios, added, back)
    sitting.details = {
        "skewed": {"--fleet": fleet, "per-replica caps (split evenly)": split_caps},
        "yield_path_frames_per_s": yield_runs,
        "yield_path_ratios": yield_ratios,
        "admitted_path_added": added,
        "killed_replica": {"back_s": back, "share_before": share_before},
    }
    sitting.write()


if __name__ == "__main__":
    main()
