"""The yield path measured from outside: a governor whose `--max-inflight 1` slot one long request
holds, refusing every frame that `yield_client` pipelines at it. The cost benchmarks
(cost/yield_throughput, cost/http_front) and the fleet's (admission/fleet, with --fleet flags) all
measure that path, so it is here once and the three cannot drift apart.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import orjson

from benchmarks.harness.common import ROOT, start_governor, stats, stop, wait_until
from governor.client import NO_RETRY, Client, Yielded
from govwire.codec import encode, generate_frame


def ndjson_yield_rate(port: int, args: argparse.Namespace) -> dict[str, float]:
    """frames_per_s, rtt_p50_ms and rtt_p99_ms of one benchmarks.harness.yield_client run (its own
    process) at `args.seconds`, `args.connections`, `args.window` and `args.batch`."""
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
            rate = ndjson_yield_rate(port, args)
            with Client("127.0.0.1", port, retry=NO_RETRY) as client:
                hints = [yielded_hint(client) for _ in range(5)]
            return rate, hints, service_time_ms
        finally:
            holder.close()
    finally:
        stop(proc)
