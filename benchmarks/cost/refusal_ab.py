"""The front door's refusal path, this checkout against an earlier commit, in one sitting.

A change to the HTTP door must not slow its hot path under overload: every 429 costs the
governor CPU that an overloaded machine has least of. This runs the same load against two
governors, one from this checkout and one from `--baseline` (a commit, extracted with `git
archive` under benchmarks/out/), each `--max-inflight 1` with the slot held by a long request, so
every measured request is refused. The two are measured round by round in alternating order with
benchmarks.harness.http_yield_client (its own process; 4 connections, windows of 1,024, batches
of 64), and the table reports the median of per-round ratios, which this machine's noise moves
together. Two loads: a plain client's requests, and the same requests with the headers the openai
SDK adds to every request (`x-stainless-retry-count: 0` among them), which the door now reads.
Beside each rate, the governor's own CPU per refusal (/proc utime+stime over the run ÷ the
refusals counted in `stats`). Target: this checkout >= 0.97x the baseline's refusals per second.

    python -m benchmarks.cost.refusal_ab --baseline d6fd6a7 [--rounds 6] [--seconds 3]
"""

from __future__ import annotations

import argparse
import io
import socket
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from subprocess import Popen
from typing import Any

from benchmarks.cost.http_front import http_yield_rate
from benchmarks.harness.common import (
    ROOT,
    cpu_seconds,
    free_port,
    machine,
    markdown_table,
    out_dir,
    stats,
    stop,
    wait_for_port,
    wait_until,
)
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order
from governor.client import Client
from govwire.codec import encode, generate_frame

TARGET = 0.97


def extract(commit: str) -> tuple[Path, str]:
    """The tree of `commit` under benchmarks/out/baseline-SHA (once), and its full hash."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True)
    full = sha.stdout.strip()
    tree = out_dir() / f"baseline-{full[:12]}"
    if not (tree / "governor").is_dir():
        archive = subprocess.run(["git", "archive", full], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
    return tree, full


class Governor:
    """One governor with its echo worker, run from `tree` (`python -m governor` there: that tree's
    packages come first on the path), its only slot held by a long request."""

    def __init__(self, name: str, tree: Path) -> None:
        self.name = name
        self.port, self.http_port = free_port(), free_port()
        argv = ["-m", "governor", "serve", "--port", str(self.port), "--http-port", str(self.http_port)]
        # the baseline's door required Content-Digest by default: both run without
        argv += ["--metrics-port", "0", "--log-level", "warning", "--max-inflight", "1", "--integrity", "optional"]
        argv += ["--", "--engine", "echo", "--token-delay-ms", "1000"]
        log = (out_dir() / f"refusal_ab_{name}.log").open("wb")
        self.proc: Popen[bytes] = Popen([sys.executable, *argv], cwd=tree, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for_port(self.port)
        wait_for_port(self.http_port)
        wait_until(lambda: stats(self.port)["workers"][0]["up"])
        with Client("127.0.0.1", self.port) as client:
            for _ in range(20):  # empty prompts end at once (eos): service times are observed
                client.generate("")
        self.holder = socket.create_connection(("127.0.0.1", self.port))
        self.holder.sendall(encode(generate_frame("holder", "x", max_new_tokens=4096, stop_on_eos=False)))
        wait_until(lambda: stats(self.port)["inflight"] == 1)

    def measure(self, args: argparse.Namespace, sdk: bool) -> dict[str, Any]:
        """One client run: its 429s per second and the governor's CPU µs per refusal."""
        cpu0, yielded0 = cpu_seconds(self.proc.pid), stats(self.port)["yielded_total"]
        result = http_yield_rate(self.http_port, args, sdk)  # (raises on any answer but a 429)
        cpu, yielded = cpu_seconds(self.proc.pid) - cpu0, stats(self.port)["yielded_total"] - yielded0
        assert stats(self.port)["inflight"] == 1, f"{self.name}: the holder lost its slot"
        return {"rate": result["responses_per_s"], "cpu_us": cpu / yielded * 1e6}

    def close(self) -> None:
        self.holder.close()
        stop(self.proc)


def table(rounds: list[dict[str, dict[str, Any]]], load: str, sitting: Sitting, baseline: str) -> str:
    rows = []
    for i, r in enumerate(rounds):
        b, c = r["baseline"], r["checkout"]
        rows.append(
            [
                str(i + 1),
                f"{b['rate']:,.0f}",
                f"{c['rate']:,.0f}",
                f"{c['rate'] / b['rate']:.3f}",
                f"{b['cpu_us']:.2f}",
                f"{c['cpu_us']:.2f}",
            ]
        )
    ratio = statistics.median(r["checkout"]["rate"] / r["baseline"]["rate"] for r in rounds)
    cpu_ratio = statistics.median(r["checkout"]["cpu_us"] / r["baseline"]["cpu_us"] for r in rounds)

    def med(side: str, key: str) -> float:
        return float(statistics.median(r[side][key] for r in rounds))

    rows.append(
        [
            "**median**",
            f"{med('baseline', 'rate'):,.0f}",
            f"{med('checkout', 'rate'):,.0f}",
            f"**{ratio:.3f}**",
            f"{med('baseline', 'cpu_us'):.2f}",
            f"{med('checkout', 'cpu_us'):.2f} ({cpu_ratio:.3f}x)",
        ]
    )
    sitting.figure(
        f"HTTP 429s/s, {load}",
        med("checkout", "rate"),
        "req/s",
        baseline=(f"the same at {baseline[:7]}", med("baseline", "rate")),
        ratio=ratio,
        bar=f">= {TARGET}x",
        met=ratio >= TARGET,
        note="ratio: the median of per-round ratios",
    )
    sitting.figure(
        f"governor CPU per HTTP 429, {load}",
        med("checkout", "cpu_us"),
        "µs",
        baseline=(f"the same at {baseline[:7]}", med("baseline", "cpu_us")),
        ratio=cpu_ratio,
        headline=False,
        note="ratio: the median of per-round ratios",
    )
    headers = ["round", f"{baseline[:7]} 429s/s", "this checkout", "ratio", "CPU µs per 429, before", "after"]
    verdict = "met" if ratio >= TARGET else "not met"
    return markdown_table(headers, rows) + f"\n\nmedian ratio **{ratio:.3f}** (target >= {TARGET}: {verdict})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    tree, baseline = extract(args.baseline)
    governors = {"baseline": Governor("baseline", tree), "checkout": Governor("checkout", ROOT)}
    loads = {"plain client": False, "openai SDK headers": True}
    results: dict[str, list[dict[str, dict[str, Any]]]] = {load: [] for load in loads}
    try:
        for i in range(args.rounds):
            for load, sdk in loads.items():
                measured = {side: governors[side].measure(args, sdk) for side in order(i, list(governors))}
                results[load].append(measured)
                b, c = measured["baseline"], measured["checkout"]
                print(
                    f"round {i + 1}, {load}: {baseline[:7]} {b['rate']:,.0f} 429s/s ({b['cpu_us']:.2f} µs),"
                    f" checkout {c['rate']:,.0f} ({c['cpu_us']:.2f} µs): {c['rate'] / b['rate']:.3f}x",
                    flush=True,
                )
    finally:
        for governor in governors.values():
            governor.close()
    print(f"\ncommand: `{sitting.command}`\nmachine: {machine()}\n")
    for load in loads:
        print(f"### {load}\n\n{table(results[load], load, sitting, baseline)}\n")
    sitting.details = {
        "baseline": baseline,
        "load": {"connections": args.connections, "window": args.window, "batch": args.batch},
        "seconds": args.seconds,
        "rounds": results,
    }
    sitting.write()


if __name__ == "__main__":
    main()
