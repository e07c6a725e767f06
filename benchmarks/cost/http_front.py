"""What the OpenAI-compatible HTTP front door (`--http-port`) costs next to the NDJSON port.

One governor serves both ports, so every comparison is the same admission on the same process and
only the door differs. The two are interleaved round by round (the order alternating), and the
tables report medians of per-round ratios or differences: this machine's noise moves both sides of
a round together, and not consecutive rounds.

a. Refusal path. `--max-inflight 1`, twenty short requests first (so the retry hint runs its
   adaptive path, as in yield_throughput.py), then one long request holds the slot: every measured
   request is refused. NDJSON: benchmarks.harness.yield_client's yield frames/s (4 connections, windows of
   1,024, batches of 64 by default). HTTP: benchmarks.harness.http_yield_client with the same pipeline
   carrying `POST /v1/completions`, its 429s counted with httptools. Beside each rate, the governor's
   own CPU time per refusal (/proc utime+stime over the client's run ÷ `yielded_total` over it),
   which is less at the mercy of the client sharing two cores with it. Target: HTTP >= 0.5x NDJSON.

b. Admitted path. A spawned echo worker (no delays), `max_tokens` 4, one keep-alive connection per
   client, closed loop: each request is sent when the previous one's whole response has arrived, and
   its latency is send -> complete response (`stream: false` on both doors, the NDJSON `done` line
   vs the HTTP 200 and its JSON body). The clients are made as cheap as each other: pre-built bytes
   on a blocking socket, the NDJSON reply read to its newline, the HTTP response split by
   httptools. A third client, the stdlib's `http.client`, shows what a plain Python client sees on
   top (its header parsing is in the figure). The clients take turns request by request (the
   first rotating per round), so all of them see the same moments of the machine. Added =
   HTTP − NDJSON in each round at each percentile. Target: < 1 ms added at p99.

    python -m benchmarks.cost.http_front [--rounds 5] [--seconds 3] [--requests 2000]
"""

from __future__ import annotations

import argparse
import http.client
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httptools
import orjson

from benchmarks.harness.common import (
    ROOT,
    cpu_seconds,
    fmt,
    machine,
    markdown_table,
    out_dir,
    start_front_door,
    stats,
    stop,
    wait_until,
)
from benchmarks.harness.http_yield_client import completion_request
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order
from benchmarks.harness.yield_path import ndjson_yield_rate
from governor.bench.stats import percentile
from governor.client import Client
from govwire.codec import encode, generate_frame

MODEL = "gpt2"  # the governor's default --served-model
PROMPT = "Summarise the following support ticket in one sentence: my order arrived late."
MAX_TOKENS = 4


def accounting(port: int) -> str:
    """The governor's counters, and any connection it shed (none is expected here)."""
    s = stats(port)
    shed = {k: v for k, v in s["connections_shed"].items() if v}
    counts = " ".join(f"{k}={s[k + '_total']}" for k in ("received", "executed", "yielded", "rejected", "failed"))
    return f"{counts} inflight={s['inflight']} connections shed: {shed or 'none'}"


# -- a. the refusal path ----------------------------------------------------------------------------


def http_yield_rate(port: int, args: argparse.Namespace, sdk: bool = False) -> dict[str, Any]:
    """One benchmarks.harness.http_yield_client run (its own process, like the NDJSON client);
    `sdk`: with the headers the openai SDK adds."""
    argv = ["--port", str(port), "--seconds", str(args.seconds), "--connections", str(args.connections)]
    argv += ["--window", str(args.window), "--batch", str(args.batch), "--model", MODEL]
    argv += ["--sdk-headers"] if sdk else []
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.http_yield_client", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = orjson.loads(out.stdout)
    if result["not_429"]:
        raise AssertionError(f"the front door answered with something other than 429 while the slot was held: {result}")
    return result


def sample_refusal(http_port: int) -> str:
    """One refused request as a plain client sees it: status, retry headers, error code."""
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
    try:
        body = orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        error = orjson.loads(resp.read())["error"]
        return (
            f"{resp.status} retry-after-ms={resp.getheader('retry-after-ms')} "
            f"retry-after={resp.getheader('retry-after')} code={error.get('code')}"
        )
    finally:
        conn.close()


def refusal_path(args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Per round, each door's client result plus the governor's CPU µs per refusal."""
    log = out_dir() / "http_front_yield.log"
    proc, port, http_port = start_front_door("--max-inflight", "1", worker_args=("--token-delay-ms", "1000"), log=log)
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        with Client("127.0.0.1", port) as client:
            for _ in range(20):  # empty prompts end at once (eos): service times get observed
                client.generate("")
        holder = socket.create_connection(("127.0.0.1", port))
        holder.sendall(encode(generate_frame("holder", "x", max_new_tokens=4096, stop_on_eos=False)))
        try:
            wait_until(lambda: stats(port)["inflight"] == 1)
            print(f"a refused HTTP request: {sample_refusal(http_port)}", flush=True)
            doors: dict[str, Callable[[], dict[str, Any]]] = {
                "ndjson": lambda: dict(ndjson_yield_rate(port, args)),
                "http": lambda: http_yield_rate(http_port, args),
            }
            for i in range(args.rounds):
                results: dict[str, dict[str, Any]] = {}
                for name in order(i, list(doors)):
                    cpu0, yielded0 = cpu_seconds(proc.pid), stats(port)["yielded_total"]
                    result = doors[name]()
                    cpu, yielded = cpu_seconds(proc.pid) - cpu0, stats(port)["yielded_total"] - yielded0
                    result["rate"] = result.get("frames_per_s", result.get("responses_per_s"))
                    result["cpu_us_per_refusal"] = cpu / yielded * 1e6
                    results[name] = result
                assert stats(port)["inflight"] == 1, "the holder lost its slot"
                rounds.append(results)
                n, h = results["ndjson"], results["http"]
                print(
                    f"round {i + 1}: NDJSON {n['rate']:,.0f} yields/s ({n['cpu_us_per_refusal']:.1f} µs CPU each),"
                    f" HTTP {h['rate']:,.0f} 429s/s ({h['cpu_us_per_refusal']:.1f} µs CPU each):"
                    f" {h['rate'] / n['rate']:.2f}x",
                    flush=True,
                )
            print(f"governor accounting after part a: {accounting(port)}", flush=True)
        finally:
            holder.close()
    finally:
        stop(proc)
    return rounds


def refusal_tables(rounds: list[dict[str, dict[str, Any]]], sitting: Sitting) -> str:
    """The refusal path's table; its medians and paired ratios also go to the result file."""
    rows = []
    for i, r in enumerate(rounds):
        n, h = r["ndjson"], r["http"]
        rows.append(
            [
                str(i + 1),
                fmt(n["rate"]),
                fmt(h["rate"]),
                f"{h['rate'] / n['rate']:.2f}",
                f"{n['cpu_us_per_refusal']:.2f}",
                f"{h['cpu_us_per_refusal']:.2f}",
                f"{n['rtt_p50_ms']:.1f} / {n['rtt_p99_ms']:.1f}",
                f"{h['rtt_p50_ms']:.1f} / {h['rtt_p99_ms']:.1f}",
            ]
        )

    def med(door: str, key: str) -> float:
        return float(statistics.median(r[door][key] for r in rounds))

    ratio = statistics.median(r["http"]["rate"] / r["ndjson"]["rate"] for r in rounds)
    cpu_ratio = statistics.median(r["http"]["cpu_us_per_refusal"] / r["ndjson"]["cpu_us_per_refusal"] for r in rounds)
    rows.append(
        [
            "**median**",
            fmt(med("ndjson", "rate")),
            fmt(med("http", "rate")),
            f"**{ratio:.2f}**",
            f"{med('ndjson', 'cpu_us_per_refusal'):.2f}",
            f"{med('http', 'cpu_us_per_refusal'):.2f} ({cpu_ratio:.2f}x)",
            f"{med('ndjson', 'rtt_p50_ms'):.1f} / {med('ndjson', 'rtt_p99_ms'):.1f}",
            f"{med('http', 'rtt_p50_ms'):.1f} / {med('http', 'rtt_p99_ms'):.1f}",
        ]
    )
    headers = [
        "round",
        "NDJSON yields/s",
        "HTTP 429s/s",
        "HTTP / NDJSON",
        "governor CPU µs per NDJSON yield",
        "per HTTP 429",
        "NDJSON RTT p50 / p99 (ms)",
        "HTTP RTT p50 / p99 (ms)",
    ]
    client_cpu = max(r[door]["client_cpu_share"] for r in rounds for door in ("ndjson", "http"))
    verdict = "met" if ratio >= 0.5 else "not met"
    sitting.figure(
        "HTTP 429s/s, the only slot held",
        med("http", "rate"),
        "req/s",
        baseline=("NDJSON yields, same governor", med("ndjson", "rate")),
        ratio=ratio,
        bar=">= 0.5x",
        met=ratio >= 0.5,
        note="ratio: the median of per-round ratios",
    )
    sitting.figure(
        "governor CPU per HTTP 429",
        med("http", "cpu_us_per_refusal"),
        "µs",
        baseline=("per NDJSON yield", med("ndjson", "cpu_us_per_refusal")),
        ratio=cpu_ratio,
        headline=False,
        note="ratio: the median of per-round ratios",
    )
    return (
        markdown_table(headers, rows)
        + f"\n\nHTTP / NDJSON refusals per second, median of paired ratios: **{ratio:.2f}** (target >= 0.5: {verdict});"
        + f" the busiest client used {client_cpu:.0%} of a core."
    )


# -- b. the admitted path ---------------------------------------------------------------------------


class NdjsonDoor:
    """A pre-encoded `stream: false` generate frame; the reply is one `done` line."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frame = generate_frame("r", PROMPT, integrity=False, max_new_tokens=MAX_TOKENS, stream=False)
        self.frame = encode(frame)

    def request(self) -> None:
        self.sock.sendall(self.frame)
        reply = b""
        while not reply.endswith(b"\n"):
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("NDJSON: the governor closed the connection")
            reply += data
        if b'"status":"done"' not in reply:
            raise AssertionError(f"NDJSON: not done: {reply[:300]!r}")

    def close(self) -> None:
        self.sock.close()


class HttpDoor:
    """A pre-built `POST /v1/completions` (`stream` false by default); the response split by httptools."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.bytes = completion_request(MODEL, PROMPT, MAX_TOKENS)
        self.parser = httptools.HttpResponseParser(self)
        self.complete = False

    def on_message_complete(self) -> None:
        self.complete = True

    def request(self) -> None:
        self.complete = False
        self.sock.sendall(self.bytes)
        while not self.complete:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("HTTP: the governor closed the connection")
            self.parser.feed_data(data)
        if self.parser.get_status_code() != 200:
            raise AssertionError(f"HTTP: status {self.parser.get_status_code()}")

    def close(self) -> None:
        self.sock.close()


class StdlibHttpDoor:
    """The same request through `http.client` (keep-alive): a plain Python client's view."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS})
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}

    def request(self) -> None:
        self.conn.request("POST", "/v1/completions", body=self.body, headers=self.headers)
        resp = self.conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise AssertionError(f"http.client: status {resp.status}")

    def close(self) -> None:
        self.conn.close()


Door = NdjsonDoor | HttpDoor | StdlibHttpDoor
DOORS = ("ndjson", "http", "http.client")
CLIENTS = {"http": "HTTP door", "http.client": "HTTP door, stdlib http.client"}  # for the figures' names


def admitted_path(args: argparse.Namespace) -> list[dict[str, tuple[float, float]]]:
    """Per round, each client's (p50, p99) latency in ms."""
    proc, port, http_port = start_front_door("--max-inflight", "64", log=out_dir() / "http_front_admitted.log")
    rounds: list[dict[str, tuple[float, float]]] = []
    try:
        doors: dict[str, Door] = {
            "ndjson": NdjsonDoor(port),
            "http": HttpDoor(http_port),
            "http.client": StdlibHttpDoor(http_port),
        }
        try:
            for door in doors.values():
                for _ in range(200):  # warm-up: connections, caches, the worker link
                    door.request()
            clock = time.perf_counter
            for i in range(args.rounds):
                turn = [doors[name] for name in order(i, DOORS, rotate=True)]
                samples: dict[int, list[float]] = {id(d): [] for d in turn}
                for _ in range(args.requests):
                    for door in turn:
                        t0 = clock()
                        door.request()
                        samples[id(door)].append((clock() - t0) * 1000)
                row: dict[str, tuple[float, float]] = {}
                for name, door in doors.items():
                    p50, p99 = percentile(samples[id(door)], 50), percentile(samples[id(door)], 99)
                    assert p50 is not None and p99 is not None
                    row[name] = (p50, p99)
                rounds.append(row)
                print(
                    f"round {i + 1}: "
                    + ", ".join(f"{name} p50 {p50:.3f} / p99 {p99:.3f} ms" for name, (p50, p99) in row.items()),
                    flush=True,
                )
        finally:
            for door in doors.values():
                door.close()
        print(f"governor accounting after part b: {accounting(port)}", flush=True)
    finally:
        stop(proc)
    return rounds


def admitted_table(rounds: list[dict[str, tuple[float, float]]], sitting: Sitting) -> str:
    """The admitted path's table; its medians (of each client's latency, of the per-round differences
    from NDJSON) also go to the result file."""
    rows = []
    p99s: dict[str, float] = {}
    for name in DOORS:
        p50 = statistics.median(r[name][0] for r in rounds)
        p99s[name] = p99 = statistics.median(r[name][1] for r in rounds)
        rows.append([f"`{name}`", f"{p50:.3f}", f"{p99:.3f}", "-"])
    worst = ""
    for name in DOORS[1:]:
        d50 = [r[name][0] - r["ndjson"][0] for r in rounds]
        d99 = [r[name][1] - r["ndjson"][1] for r in rounds]
        added = statistics.median(d99)
        per_round = ", ".join(f"{x:+.3f}" for x in d99)
        rows.append([f"**added** (`{name}` − `ndjson`)", f"{statistics.median(d50):+.3f}", "", per_round])
        rows[-1][2] = f"**{added:+.3f}**" if name == "http" else f"{added:+.3f}"
        if name == "http":
            worst = (
                f"HTTP front door added at p99, median over rounds: **{added:+.3f} ms** (target < 1 ms:"
                f" {'met' if added < 1 else 'not met'}); largest single round {max(d99):+.3f} ms."
            )
        client, http = CLIENTS[name], name == "http"
        sitting.figure(
            f"admitted latency p99, {client}",
            p99s[name],
            "ms",
            baseline=("NDJSON door", p99s["ndjson"]),
            difference=added,
            bar="< 1 ms added" if http else None,
            met=added < 1 if http else None,
            headline=http,
            note=f"difference: the median over rounds of each round's; per round {per_round}",
        )
        sitting.figure(
            f"admitted latency p50, {client}",
            statistics.median(r[name][0] for r in rounds),
            "ms",
            baseline=("NDJSON door", statistics.median(r["ndjson"][0] for r in rounds)),
            difference=statistics.median(d50),
            headline=False,
        )
    headers = ["client", "latency p50 (ms)", "latency p99 (ms)", "per round, p99 (ms)"]
    return markdown_table(headers, rows) + "\n\n" + worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="refusal path: measured seconds per client run")
    parser.add_argument("--connections", type=int, default=4, help="refusal path, both clients")
    parser.add_argument("--window", type=int, default=1024, help="refusal path: requests in flight per connection")
    parser.add_argument("--batch", type=int, default=64, help="refusal path: requests per write")
    parser.add_argument("--requests", type=int, default=2000, help="admitted path: requests per client per round")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    print("## a. refusal path", flush=True)
    refusals = refusal_path(args)
    print("\n## b. admitted path", flush=True)
    admitted = admitted_path(args)
    print(f"\ncommand: `{sitting.command}`\nmachine: {machine()}\n")
    print(
        f"a. refusals: `--max-inflight 1`, the slot held; {args.rounds} rounds of {args.seconds:g} s per door,"
        f" {args.connections} connections x {args.window} in flight, batches of {args.batch}\n"
    )
    print(refusal_tables(refusals, sitting))
    print(
        f"\nb. admitted: echo worker, max_tokens {MAX_TOKENS}, stream false, one keep-alive connection per client,"
        f" closed loop; {args.rounds} rounds of {args.requests} requests per client, taking turns;"
        " medians over rounds\n"
    )
    print(admitted_table(admitted, sitting))
    sitting.details = {
        "refusals": {
            "load": {"connections": args.connections, "window": args.window, "batch": args.batch},
            "seconds": args.seconds,
            "rounds": refusals,
        },
        "admitted": {"requests_per_round": args.requests, "max_tokens": MAX_TOKENS, "rounds_p50_p99_ms": admitted},
    }
    sitting.write()


if __name__ == "__main__":
    main()
