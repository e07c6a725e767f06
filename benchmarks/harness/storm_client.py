#!/usr/bin/env python3
"""A rate-controlled storm of NDJSON generate frames that the governor must refuse (peers/proxies.py isolation).

Open loop: every TICK_S each of --connections connections writes its share of --rate frames per
second in one write (so the storm arrives as many small bursts, as many retrying clients would,
not as one deep pipeline). Frames name the tenant `storm`; the governor under test runs with
`--tenant storm,max_inflight=1 --tenant-from frame`, so all but one at a time are refused with a
`yield` (`tenant_inflight`, a computed hint) while the other clients' frames are still admitted.
Replies are only counted (newlines, and `"status":"yield"` occurrences), so the client stays cheap.
--rate 0 = as fast as the connections' windows allow (a closed-loop pipeline of --window frames
per connection).

Prints one JSON object when it ends (after --seconds, or on SIGTERM): frames sent, replies,
yields, the achieved reply rate over the measured span, and this process's CPU share.

    python storm_client.py --port P --rate 50000 --connections 16 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import time

import uvloop

PROMPT = "Summarise the following support ticket in one sentence: my order arrived late."
TICK_S = 0.002


def frame(i: int) -> bytes:
    data = PROMPT.encode()
    obj = {
        "id": f"s{i}",
        "op": "generate",
        "prompt": PROMPT,
        "max_new_tokens": 16,
        "tenant": "storm",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


FRAMES = [frame(i) for i in range(4096)]


class Storm(asyncio.Protocol):
    def __init__(self, stats: dict[str, int], window: int) -> None:
        self.stats = stats
        self.window = window
        self.cursor = 0
        self.outstanding = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, n: int) -> None:
        if n <= 0 or self.transport is None or self.transport.is_closing():
            return
        end = self.cursor + n
        if end <= len(FRAMES):
            chunk = b"".join(FRAMES[self.cursor : end])
        else:
            chunk = b"".join(FRAMES[self.cursor :] + FRAMES[: end - len(FRAMES)])
        self.cursor = end % len(FRAMES)
        self.transport.write(chunk)
        self.outstanding += n
        self.stats["sent"] += n

    def data_received(self, data: bytes) -> None:
        n = data.count(b"\n")
        self.outstanding -= n
        self.stats["replies"] += n
        self.stats["yields"] += data.count(b'"status":"yield"')
        if self.window:  # closed loop: keep the window full
            self.send(self.window - self.outstanding)


async def main(a: argparse.Namespace) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    stats = {"sent": 0, "replies": 0, "yields": 0}
    window = a.window if a.rate == 0 else 0
    conns = []
    for _ in range(a.connections):
        _, proto = await loop.create_connection(lambda: Storm(stats, window), "127.0.0.1", a.port)
        conns.append(proto)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if window:
        for c in conns:
            c.send(window)
    per_tick = a.rate * TICK_S / max(1, a.connections)
    owed = [0.0] * len(conns)
    t_start = time.perf_counter()
    next_tick = t_start
    measured_from = t_start + a.warmup
    base: tuple[float, int, float] | None = None
    while not stop.is_set() and time.perf_counter() - t_start < a.warmup + a.seconds:
        now = time.perf_counter()
        if base is None and now >= measured_from:
            base = (now, stats["replies"], time.process_time())
        if a.rate:
            for k, c in enumerate(conns):
                owed[k] += per_tick
                n = int(owed[k])
                if n and c.outstanding < a.max_outstanding:  # never build an unbounded backlog
                    c.send(n)
                owed[k] -= n
            next_tick += TICK_S
            delay = next_tick - time.perf_counter()
            if delay < -0.05:  # fell behind: do not try to catch up in one burst
                next_tick = time.perf_counter()
                delay = 0
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, delay))
            except TimeoutError:
                pass
        else:
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.05)
            except TimeoutError:
                pass
    end = time.perf_counter()
    if base is None:
        base = (t_start, 0, 0.0)
    span = end - base[0]
    result = {
        "target_rate": a.rate,
        "connections": a.connections,
        "sent": stats["sent"],
        "replies": stats["replies"],
        "yields": stats["yields"],
        "non_yield_replies": stats["replies"] - stats["yields"],
        "reply_rate": (stats["replies"] - base[1]) / span if span > 0 else 0.0,
        "measured_s": span,
        "client_cpu_share": (time.process_time() - base[2]) / span if span > 0 else 0.0,
    }
    for c in conns:
        if c.transport is not None:
            c.transport.close()
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=float, default=50_000, help="frames/s over all connections; 0 = closed loop")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--window", type=int, default=256, help="closed loop (--rate 0): frames in flight per connection")
    p.add_argument("--max-outstanding", type=int, default=4096, help="open loop: unanswered frames per connection")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=1.0)
    args = p.parse_args()
    print(json.dumps(uvloop.run(main(args))), flush=True)
