"""Pipelined load client for the yield benchmark: keeps a window of frames in flight per connection.

Frames are pre-encoded generate frames with size and sha256, as a real client sends them. The
client only counts reply lines, so it stays far cheaper per frame than any server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvloop

from governor.wire import encode, generate_frame

PROMPT = "Summarise the following support ticket in one sentence: my order arrived late."


class Pipeline(asyncio.Protocol):
    def __init__(self, frames: list[bytes], batch: int, window: int) -> None:
        self.frames = frames
        self.batch = batch
        self.window = window
        self.sent = 0
        self.received = 0
        self.cursor = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.top_up()

    def top_up(self) -> None:
        while self.sent - self.received + self.batch <= self.window:
            end = self.cursor + self.batch
            self.transport.write(b"".join(self.frames[self.cursor : end]))
            self.cursor = 0 if end >= len(self.frames) else end
            self.sent += self.batch

    def data_received(self, data: bytes) -> None:
        self.received += data.count(b"\n")
        self.top_up()


async def run(port: int, connections: int, seconds: float, warmup: float, batch: int, window: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    frames = [encode(generate_frame(f"r{i}", PROMPT, max_new_tokens=16)) for i in range(batch * 50)]
    pipes = []
    for _ in range(connections):
        _, proto = await loop.create_connection(lambda: Pipeline(frames, batch, window), "127.0.0.1", port)
        pipes.append(proto)
    await asyncio.sleep(warmup)
    start_count, t0 = sum(p.received for p in pipes), time.perf_counter()
    await asyncio.sleep(seconds)
    count, elapsed = sum(p.received for p in pipes) - start_count, time.perf_counter() - t0
    for p in pipes:
        p.transport.close()
    return {"frames": count, "seconds": elapsed, "frames_per_s": count / elapsed}


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
