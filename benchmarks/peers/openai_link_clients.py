"""Which HTTP client should the OpenAI-compatible link stream with? The three candidates side by
side, each relaying streamed completions from the same canned upstream, in one sitting:

- `httpx`: `httpx.AsyncClient.stream` (httpcore, h11) with `httpx_sse.EventSource`, tuned (no
  connection limit, keep-alive, no proxy lookup): the link's client before issue 34;
- `aiohttp`: `aiohttp.ClientSession.post` (its C response parser), reading the body's lines;
- `governor`: the link's own, `links/http_client.HttpPool` with `links/sse.SseDecoder` (httptools).

Each reads every event's data and parses it with orjson, as a relay must. The upstream runs in its
own process (a canned response, keep-alive) pinned to core 1, the client to core 0 (`taskset`,
where there are two cores); the figure is the client's own CPU time per request (process time ÷
requests), at 4 and 64 tokens per request, from which the per-request and per-token costs follow
(a straight line through the two). Three rounds alternating the clients; medians.

    python -m benchmarks.peers.openai_link_clients [--requests 4000] [--concurrency 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import orjson

from benchmarks.harness import rounds
from benchmarks.harness.common import free_port, wait_for_port
from benchmarks.harness.results import Sitting

CLIENTS = ("httpx", "aiohttp", "governor")


def canned_body(tokens: int) -> bytes:
    events = [b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"t%d"}]}' % i for i in range(tokens)]
    events.append(b'{"id":"c","choices":[{"index":0,"text":"","finish_reason":"length"}]}')
    events.append(b'{"id":"c","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d}}' % tokens)
    events.append(b"[DONE]")
    return b"".join(b"data: " + e + b"\n\n" for e in events)


UPSTREAM = r"""
import asyncio, sys
import uvloop
body = sys.stdin.buffer.read()
response = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
class Canned(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(response)
async def main():
    server = await asyncio.get_running_loop().create_server(Canned, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    await server.serve_forever()
uvloop.run(main())
"""


def start_upstream(port: int, tokens: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", UPSTREAM, str(port)]
    if (os.cpu_count() or 1) >= 2:
        argv = ["taskset", "-c", "1", *argv]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(canned_body(tokens))
    proc.stdin.close()
    wait_for_port(port)
    return proc


BODY = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True})


async def run_httpx(port: int, requests: int, concurrency: int) -> int:
    import httpx
    from httpx_sse import EventSource

    events = 0
    url = f"http://127.0.0.1:{port}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:

        async def one() -> None:
            nonlocal events
            async with client.stream("POST", url, content=BODY, headers={"content-type": "application/json"}) as r:
                async for event in EventSource(r).aiter_sse():
                    if event.data != "[DONE]":
                        orjson.loads(event.data)
                    events += 1

        await _spread(one, requests, concurrency)
    return events


async def run_aiohttp(port: int, requests: int, concurrency: int) -> int:
    import aiohttp

    events = 0
    url = f"http://127.0.0.1:{port}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal events
            async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        data = line[6:].rstrip(b"\r\n")
                        if data != b"[DONE]":
                            orjson.loads(data)
                        events += 1

        await _spread(one, requests, concurrency)
    return events


async def run_governor(port: int, requests: int, concurrency: int) -> int:
    from governor.links.http_client import HttpClientError, HttpPool, request_head
    from governor.links.sse import SseDecoder

    events = 0
    pool = HttpPool("127.0.0.1", port, 5.0, 30.0)
    head = request_head(b"POST", b"/v1/completions", b"127.0.0.1", b"content-type: application/json\r\n", len(BODY))

    class Handler:
        def __init__(self) -> None:
            self.decoder = SseDecoder()
            self.done = asyncio.get_running_loop().create_future()

        def response_head(self, status: int, headers: dict[bytes, bytes]) -> None:
            pass

        def response_body(self, data: bytes) -> None:
            nonlocal events
            for event in self.decoder.feed(data):
                if event != b"[DONE]":
                    orjson.loads(event)
                events += 1

        def response_end(self) -> None:
            self.done.set_result(None)

        def response_failed(self, error: HttpClientError) -> None:
            self.done.set_exception(error)

        def read_done(self) -> None:
            pass

    async def one() -> None:
        handler = Handler()
        pool.start(head + BODY, handler)
        await handler.done

    await _spread(one, requests, concurrency)
    pool.close()
    return events


async def _spread(one: Callable[[], Awaitable[None]], requests: int, concurrency: int) -> None:
    left = requests

    async def lane() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    await asyncio.gather(*(lane() for _ in range(concurrency)))


RUNNERS = {"httpx": run_httpx, "aiohttp": run_aiohttp, "governor": run_governor}


def measure(client: str, port: int, requests: int, concurrency: int, tokens: int) -> dict[str, float]:
    import uvloop

    runner = RUNNERS[client]
    uvloop.run(runner(port, requests // 10, concurrency))  # warm-up: connections, imports
    cpu, wall = time.process_time(), time.perf_counter()
    events = uvloop.run(runner(port, requests, concurrency))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert events == requests * (tokens + 3), (client, events)
    return {"req_per_s": requests / wall, "cpu_us_per_req": cpu / requests * 1e6}


# (figure name, the key in a client's medians, unit, headline)
FIGURES = (
    ("link client CPU per request, 4 tokens", "cpu_us_per_req_4_tokens", "µs", True),
    ("link client CPU per request, 64 tokens", "cpu_us_per_req_64_tokens", "µs", False),
    ("link client fixed CPU per request (fitted)", "cpu_us_per_request", "µs", False),
    ("link client CPU per token (fitted)", "cpu_us_per_token", "µs", False),
    ("link client req/s, 4 tokens", "req_per_s_4_tokens", "req/s", False),
    ("link client req/s, 64 tokens", "req_per_s_64_tokens", "req/s", False),
)


def record(
    sitting: Sitting, medians: dict[str, dict[str, float]], results: dict[tuple[str, int], list[dict[str, float]]]
) -> None:
    """The link's own client beside aiohttp and httpx, each figure once per baseline: the headline is
    its CPU per short streamed request; the per-round runs go in the details."""
    for name, key, unit, headline in FIGURES:
        for baseline in ("aiohttp", "httpx"):
            ours, theirs = medians["governor"][key], medians[baseline][key]
            sitting.figure(f"{name}, vs {baseline}", ours, unit, baseline=(baseline, theirs), headline=headline)
    sitting.details = {
        "medians": medians,
        "rounds": {f"{client} {tokens} tokens": runs for (client, tokens), runs in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sitting = Sitting(("governor",))
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for tokens in (4, 64):
        port = free_port()
        upstream = start_upstream(port, tokens)
        try:
            for round_ in range(args.rounds):
                for client in rounds.order(round_, CLIENTS):
                    row = measure(client, port, args.requests, args.concurrency, tokens)
                    results.setdefault((client, tokens), []).append(row)
                    print(f"round {round_ + 1} {client:8} tokens={tokens:2}: {row['req_per_s']:9,.0f} req/s "
                          f"{row['cpu_us_per_req']:8.1f} us CPU/req", flush=True)  # fmt: skip
        finally:
            upstream.terminate()
            upstream.wait()
    print("\nclient     4 tokens: us/req  req/s | 64 tokens: us/req  req/s | per request  per token (us)")
    medians: dict[str, dict[str, float]] = {}
    for client in CLIENTS:
        short = statistics.median(r["cpu_us_per_req"] for r in results[(client, 4)])
        long = statistics.median(r["cpu_us_per_req"] for r in results[(client, 64)])
        rate4 = statistics.median(r["req_per_s"] for r in results[(client, 4)])
        rate64 = statistics.median(r["req_per_s"] for r in results[(client, 64)])
        per_token = (long - short) / 60
        print(f"{client:9} {short:9.1f} {rate4:8,.0f} | {long:9.1f} {rate64:7,.0f} | {short - 4 * per_token:10.1f} "
              f"{per_token:9.2f}")  # fmt: skip
        medians[client] = {
            "cpu_us_per_req_4_tokens": short,
            "cpu_us_per_req_64_tokens": long,
            "req_per_s_4_tokens": rate4,
            "req_per_s_64_tokens": rate64,
            "cpu_us_per_request": short - 4 * per_token,
            "cpu_us_per_token": per_token,
        }
    record(sitting, medians, results)
    sitting.write()


if __name__ == "__main__":
    main()
