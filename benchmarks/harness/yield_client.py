"""Pipelined load client for the yield benchmark: keeps a window of frames in flight per connection.

Frames are pre-encoded generate frames with size and sha256, as a real client sends them. The
client only counts reply lines, so it stays far cheaper per frame than any server it measures.
A reply's round trip is measured from the write of its batch to the read that brought it (replies
come back in order on each connection), weighted by the replies in each read.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from collections.abc import Callable

import orjson
import uvloop

from govwire.codec import encode, generate_frame

PROMPT = "Summarise the following support ticket in one sentence: my order arrived late."


class Pipeline(asyncio.Protocol):
    def __init__(self, frames: list[bytes], batch: int, window: int) -> None:
        self.frames = frames
        self.batch = batch
        self.window = window
        self.sent = 0
        self.received = 0
        self.cursor = 0
        self.in_flight: deque[list[float]] = deque()  # [sent at, replies still due] per batch
        self.rtts: list[tuple[float, int]] | None = None  # (round trip, replies) once measuring

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.top_up()

    def top_up(self) -> None:
        while self.sent - self.received + self.batch <= self.window:
            end = self.cursor + self.batch
            self.transport.write(b"".join(self.frames[self.cursor : end]))
            self.cursor = 0 if end >= len(self.frames) else end
            self.sent += self.batch
            self.in_flight.append([time.perf_counter(), self.batch])

    def data_received(self, data: bytes) -> None:
        self.replied(time.perf_counter(), data.count(b"\n"))

    def replied(self, now: float, replies: int) -> None:
        """`replies` more replies read at `now`: their round trips, then the window is topped up.
        (benchmarks.harness.http_yield_client counts HTTP responses with a parser and calls this.)"""
        self.received += replies
        while replies:
            batch = self.in_flight[0]
            taken = min(replies, int(batch[1]))
            if self.rtts is not None:
                self.rtts.append((now - batch[0], taken))
            batch[1] -= taken
            replies -= taken
            if not batch[1]:
                self.in_flight.popleft()
        self.top_up()


def weighted_percentile(samples: list[tuple[float, int]], q: float) -> float:
    ordered = sorted(samples)
    target = q / 100 * sum(n for _, n in ordered)
    seen = 0
    for value, n in ordered:
        seen += n
        if seen >= target:
            return value
    return ordered[-1][0]


async def run(port: int, connections: int, seconds: float, warmup: float, batch: int, window: int) -> dict[str, float]:
    frames = [encode(generate_frame(f"r{i}", PROMPT, max_new_tokens=16)) for i in range(batch * 50)]
    _, result = await drive(port, connections, seconds, warmup, lambda: Pipeline(frames, batch, window))
    return result


async def drive(
    port: int, connections: int, seconds: float, warmup: float, pipeline: Callable[[], Pipeline]
) -> tuple[list[Pipeline], dict[str, float]]:
    """Open `connections` pipelines, let them run `warmup` s, then count their replies for `seconds`."""
    loop = asyncio.get_running_loop()
    pipes = []
    for _ in range(connections):
        _, proto = await loop.create_connection(pipeline, "127.0.0.1", port)
        pipes.append(proto)
    await asyncio.sleep(warmup)
    for p in pipes:
        p.rtts = []
    start_count, t0, cpu0 = sum(p.received for p in pipes), time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    count, elapsed = sum(p.received for p in pipes) - start_count, time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    for p in pipes:
        p.transport.close()
    rtts = [x for p in pipes for x in p.rtts or ()]
    return pipes, {
        "frames": count,
        "seconds": elapsed,
        "frames_per_s": count / elapsed,
        "rtt_p50_ms": weighted_percentile(rtts, 50) * 1000,
        "rtt_p99_ms": weighted_percentile(rtts, 99) * 1000,
        "client_cpu_share": cpu / elapsed,  # near 1.0: the client, not the server, limits the rate
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024)
    a = parser.parse_args()
    result = uvloop.run(run(a.port, a.connections, a.seconds, a.warmup, a.batch, a.window))
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
