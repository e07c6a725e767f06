"""Governor RSS: idle, with 1,000 idle connections, and after 100k / 200k requests.

Bounded by construction means the last two numbers are the same: no per-request state survives
its final reply. Requests go through the real spawned echo worker (no delays), 8 connections
keeping 8 requests each in flight (= --max-inflight 64, so nearly all are admitted).

    python -m benchmarks.cost.memory [--requests 100000] [--idle-connections 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

import orjson

from benchmarks.harness.common import machine, rss_mib, start_governor, stats, stop, wait_until
from benchmarks.harness.results import Sitting
from govwire.codec import encode, generate_frame
from govwire.vocab import FINAL_STATUSES

PROMPT = "a short prompt of about thirty-two bytes"


class Closed(asyncio.Protocol):
    """Keeps `depth` requests in flight until `budget` final replies were received."""

    def __init__(self, name: str, depth: int, budget: int, done: asyncio.Future[None]) -> None:
        self.name, self.depth, self.budget, self.done_future = name, depth, budget, done
        self.sent = self.finals = 0
        self.statuses: dict[str, int] = {}
        self.partial = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.send(self.depth)

    def send(self, n: int) -> None:
        n = min(n, self.budget - self.sent)
        frames = [encode(generate_frame(f"{self.name}-{self.sent + i}", PROMPT, max_new_tokens=8)) for i in range(n)]
        self.sent += n
        if frames:
            self.transport.write(b"".join(frames))

    def data_received(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        finished = 0
        for line in lines:
            status = orjson.loads(line)["status"]
            if status in FINAL_STATUSES:
                finished += 1
                self.statuses[status] = self.statuses.get(status, 0) + 1
        self.finals += finished
        self.send(finished)
        if self.finals >= self.budget and not self.done_future.done():
            self.done_future.set_result(None)


async def load(port: int, requests: int, connections: int = 8, depth: int = 8) -> dict[str, int]:
    loop = asyncio.get_running_loop()
    futures, protos = [], []
    for i in range(connections):
        future: asyncio.Future[None] = loop.create_future()
        _, proto = await loop.create_connection(
            lambda i=i, f=future: Closed(f"c{i}", depth, requests // connections, f), "127.0.0.1", port
        )
        futures.append(future)
        protos.append(proto)
    await asyncio.gather(*futures)
    totals: dict[str, int] = {}
    for p in protos:
        p.transport.close()
        for k, v in p.statuses.items():
            totals[k] = totals.get(k, 0) + v
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--idle-connections", type=int, default=1000)
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    proc, port = start_governor("--max-inflight", "64")
    try:
        time.sleep(1.0)
        rows = [("idle, worker connected", rss_mib(proc.pid), "")]

        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.idle_connections)]
        wait_until(lambda: stats(port)["connections"] >= args.idle_connections)
        rows.append((f"{args.idle_connections} idle connections open", rss_mib(proc.pid), ""))
        for s in idle:
            s.close()
        wait_until(lambda: stats(port)["connections"] <= 1)
        rows.append(("after closing them", rss_mib(proc.pid), ""))

        done = 0
        rates: list[float] = []  # req/s of each pass
        for _ in range(2):
            t0 = time.perf_counter()
            totals = asyncio.run(load(port, args.requests))
            elapsed = time.perf_counter() - t0
            done += args.requests
            rates.append(args.requests / elapsed)
            note = f"{rates[-1]:,.0f} req/s; " + ", ".join(f"{k}={v}" for k, v in sorted(totals.items()))
            rows.append((f"after {done:,} requests", rss_mib(proc.pid), note))
        final = stats(port)
        worker_pid = final["workers"][0]["pid"]
        assert final["inflight"] == 0, final
    finally:
        worker_rss = rss_mib(worker_pid) if proc.poll() is None else float("nan")
        stop(proc)
    print(f"machine: {machine()}")
    print("| governor state | RSS (MiB) | notes |\n|---|---|---|")
    for label, rss, note in rows:
        print(f"| {label} | {rss:.1f} | {note} |")
    print(f"\nworker (echo) RSS at the end: {worker_rss:.1f} MiB")
    print(
        f"accounting at the end: received={final['received_total']} executed={final['executed_total']} "
        f"yielded={final['yielded_total']} rejected={final['rejected_total']} failed={final['failed_total']}"
    )
    # Bounded by construction: the headline is the RSS idle and after the second pass, beside the first.
    for i, (label, rss, _) in enumerate(rows):
        last = i == len(rows) - 1
        before = (rows[i - 1][0], rows[i - 1][1]) if last else None
        sitting.figure(f"governor RSS, {label}", rss, "MiB", baseline=before, headline=i == 0 or last)
    sitting.figure("echo worker RSS at the end", worker_rss, "MiB", headline=False)
    sitting.details = {
        "rows": [{"state": label, "rss_mib": rss, "note": note} for label, rss, note in rows],
        "requests_per_s": rates,
        "accounting": {k: final[f"{k}_total"] for k in ("received", "executed", "yielded", "rejected", "failed")},
    }
    sitting.write()


if __name__ == "__main__":
    main()
