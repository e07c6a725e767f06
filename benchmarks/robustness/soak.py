"""Soak: a real governor under well-behaved and hostile clients at once, for a while.

    python -m benchmarks.robustness.soak --seconds 60 [--seed 0] [--valid-clients 4] [--hostile-connections 100]
                              [--json PATH]

Starts a governor with the echo worker (1 ms per token, so requests stay in flight) and for
`--seconds` runs well-behaved clients (sequential generate requests, retried after each yield's
hint) beside hostile connections: benchmarks/robustness/fuzz.py's mutation mix, slowloris connections that
trickle a frame a byte every 0.5-1 s and never end it, idle connections, clients that pipeline
requests and never read a reply, and clients that vanish mid-stream. Hostile connections are
replaced when they end, by themselves (after 5-30 s) or by the server. The governor's connection
limits (`--idle-timeout-s`, ...) are passed when its `serve --help` lists them.

It samples the governor's RSS every 5 s, closes every client, waits (bounded) for inflight to
reach 0 and reports frames, replies, connections and how they ended, leaked slots, the counter
balance, RSS and the well-behaved clients' latency. Exits 1 when a slot leaked, the counters do not
balance, the governor died, a reply broke the protocol or the well-behaved clients completed nothing.
The result file leads with the slots leaked (bar: 0) and the RSS growth (no bar: docs/reliability.md
reads it per executed request, which the file holds too).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchmarks.harness.common import rss_mib, start_governor, stop
from benchmarks.harness.results import Sitting
from benchmarks.robustness.fuzz import (
    MAX_FRAME_BYTES,
    WORKER_ARGS,
    Report,
    check_reply,
    check_server,
    fuzz,
    imbalance,
)
from governor.bench.stats import Distribution
from govwire.codec import encode, generate_frame
from govwire.vocab import FINAL_STATUSES

PROMPT = "soak: a well-behaved prompt"
MAX_NEW_TOKENS_LIMIT = 64
# The i-th hostile connection's kind: 100 connections are 30 slowloris, 30 idle, 20 unread, 10 fuzz, 10 midstream.
HOSTILE_PATTERN = (
    "slowloris", "idle", "unread", "fuzz", "slowloris", "idle", "midstream", "unread", "idle", "slowloris",
)  # fmt: skip
LIFETIME_S = (5.0, 30.0)  # how long a client keeps a connection before replacing it
UNREAD_BURST = 16  # requests a non-reading client pipelines before it just holds the connection
REPLY_TIMEOUT_S = 30.0  # a well-behaved request without its final reply by then is a failure
RSS_EVERY_S = 5.0
TCP_ESTABLISHED = 1  # tcpi_state in Linux's struct tcp_info
GRACE_S = 60.0  # beyond --seconds: fuzz connections drain, then the whole run is cut off
# Connection limits, set low enough that the soak reaches them; 0 leaves the governor's default.
LIMITS: dict[str, tuple[type, float, str]] = {
    "--idle-timeout-s": (float, 10.0, "so idle and slowloris connections are cut within the run"),
    "--max-connections": (int, 4096, "above what the soak opens"),
    "--max-buffer-bytes": (int, 4 << 20, "unfinished-frame bytes over all connections"),
    "--max-write-buffer-bytes": (int, 64 << 10, "unread reply bytes per connection (the smallest allowed)"),
}


@dataclass
class Tally:
    """What the clients saw; fuzz's Report holds frames, replies, lines sent and protocol failures."""

    report: Report = field(default_factory=Report)
    opened: Counter[str] = field(default_factory=Counter)  # connections by kind
    ended: Counter[str] = field(default_factory=Counter)  # "kind:by_server" / "kind:by_client"
    latencies_ms: list[float] = field(default_factory=list)  # well-behaved requests that ended done
    retries: int = 0  # well-behaved attempts after a yield


Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter, random.Random, Tally, float], Awaitable[bool]]


def _frame(rid: str, max_new_tokens: int, **fields: Any) -> bytes:
    return encode(generate_frame(rid, PROMPT, max_new_tokens=max_new_tokens, **fields))


def _sent(tally: Tally, kind: str, frame: bytes) -> None:
    tally.report.sent[kind] += 1
    tally.report.lines_sent += frame.endswith(b"\n")


async def _read_all(reader: asyncio.StreamReader, tally: Tally) -> None:
    """Tally replies until the server closes the connection."""
    try:
        while line := await reader.readline():
            check_reply(line, tally.report)
    except ConnectionError:
        pass


async def _server_closes(reading: asyncio.Task[None], seconds: float) -> bool:
    done, _ = await asyncio.wait({reading}, timeout=max(0.0, seconds))
    return bool(done)


async def generate(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: str, tally: Tally, max_new_tokens: int
) -> dict[str, Any]:
    """One request to its final reply other than `yield`, retried after each yield's hint.
    Raises IncompleteReadError when the server closes the connection."""
    while True:
        frame = _frame(rid, max_new_tokens)
        writer.write(frame)
        _sent(tally, "well_behaved", frame)
        reply: dict[str, Any] = {}
        while reply.get("status") not in FINAL_STATUSES:
            line = await reader.readuntil(b"\n")
            check_reply(line, tally.report)
            reply = orjson.loads(line)
        if reply["status"] != "yield":
            return reply
        tally.retries += 1
        await asyncio.sleep(reply["retry_hint_ms"] / 1000)


async def _well_behaved(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random, tally: Tally, until: float
) -> bool:
    for n in itertools.count():
        start = time.monotonic()
        if start >= until:
            return False
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                final = await generate(reader, writer, f"w{n}", tally, rng.randint(1, 16))
        except TimeoutError:
            tally.report.failures.append(f"a well-behaved request got no final reply in {REPLY_TIMEOUT_S:.0f} s")
            return False
        if final["status"] == "done":
            tally.latencies_ms.append((time.monotonic() - start) * 1000)
        await asyncio.sleep(rng.uniform(0, 0.02))
    return False  # for mypy: the loop above has no end


async def _slowloris(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random, tally: Tally, until: float
) -> bool:
    """A frame a byte at a time without its newline, then spaces (JSON whitespace): a partial frame
    that keeps growing and never completes."""
    reading = asyncio.create_task(_read_all(reader, tally))
    data = _frame("slow", 8).rstrip(b"\n")
    _sent(tally, "slowloris (partial)", data)
    try:
        for i in itertools.count():
            writer.write(data[i : i + 1] or b" ")
            left = until - time.monotonic()
            if left <= 0 or await _server_closes(reading, min(left, rng.uniform(0.5, 1.0))):
                return left > 0
    finally:
        reading.cancel()
    return False  # for mypy: the loop above has no end


async def _idle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random, tally: Tally, until: float
) -> bool:
    reading = asyncio.create_task(_read_all(reader, tally))
    try:
        return await _server_closes(reading, until - time.monotonic())
    finally:
        reading.cancel()


async def _unread(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random, tally: Tally, until: float
) -> bool:
    """Pipeline long streamed requests, then hold the connection and never read a reply."""
    for n in range(UNREAD_BURST):
        frame = _frame(f"u{n}", MAX_NEW_TOKENS_LIMIT, stop_on_eos=False)
        writer.write(frame)
        _sent(tally, "unread", frame)
    sock = writer.get_extra_info("socket")
    while (left := until - time.monotonic()) > 0:
        # Reading is paused, so a close by the server shows only in the TCP state (Linux's TCP_INFO).
        if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED:
            return True
        await asyncio.sleep(min(left, 0.5))
    return False


async def _midstream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random, tally: Tally, until: float
) -> bool:
    """Start a long request and vanish: inside the frame, after the first reply, or by a half-close."""
    frame = _frame("m", MAX_NEW_TOKENS_LIMIT, stop_on_eos=False)
    how = rng.choice(["inside_frame", "after_first_reply", "half_close"])
    if how == "inside_frame":
        frame = frame[: rng.randrange(1, len(frame) - 1)]
    writer.write(frame)
    _sent(tally, f"midstream ({how})", frame)
    if how == "half_close":
        writer.write_eof()
    elif how == "after_first_reply":
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            check_reply(await reader.readuntil(b"\n"), tally.report)
    await writer.drain()
    return False


BEHAVIOURS: dict[str, Behaviour] = {
    "well_behaved": _well_behaved,
    "slowloris": _slowloris,
    "idle": _idle,
    "unread": _unread,
    "midstream": _midstream,
}


async def open_connection(port: int, small_buffers: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection; with `small_buffers` a client that stops reading pushes back on the
    server after a few KiB instead of the megabytes loopback buffers by default."""
    if not small_buffers:
        return await asyncio.open_connection("127.0.0.1", port)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=1)  # the reader pauses at once, so nothing is read


async def hold(kind: str, port: int, rng: random.Random, tally: Tally, until: float) -> None:
    """One connection of `kind` until `until` (time.monotonic), its behaviour's end or the server's close."""
    reader, writer = await open_connection(port, small_buffers=kind == "unread")
    tally.opened[kind] += 1
    by_server = False
    try:
        by_server = await BEHAVIOURS[kind](reader, writer, rng, tally, until)
    except (ConnectionError, asyncio.IncompleteReadError):
        by_server = True
    except TimeoutError:
        by_server = False
        tally.report.failures.append(f"a {kind} connection got no reply in {REPLY_TIMEOUT_S:.0f} s")
    finally:
        tally.ended[f"{kind}:{'by_server' if by_server else 'by_client'}"] += 1
        writer.close()


async def _lane(kind: str, port: int, rng: random.Random, tally: Tally, deadline: float) -> None:
    """Connections of one kind, one after the other, until the deadline."""
    while time.monotonic() < deadline:
        try:
            await hold(kind, port, rng, tally, min(deadline, time.monotonic() + rng.uniform(*LIFETIME_S)))
        except OSError as exc:
            tally.report.failures.append(f"{kind} connection error: {exc!r}")
            return
        if kind == "midstream":
            await asyncio.sleep(rng.uniform(0.05, 0.3))


async def _sample_rss(pid: int, samples: list[float], deadline: float) -> None:
    while True:
        try:
            samples.append(rss_mib(pid))
        except OSError:  # the governor is gone; the report says so
            return
        if (left := deadline - time.monotonic()) <= 0:
            return
        await asyncio.sleep(min(RSS_EVERY_S, left))


async def soak(port: int, pid: int, args: argparse.Namespace, rss: list[float]) -> Tally:
    tally = Tally()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.seconds
    kinds = Counter(itertools.islice(itertools.cycle(HOSTILE_PATTERN), args.hostile_connections))
    lanes = [("well_behaved", args.valid_clients), *((k, n) for k, n in kinds.items() if k != "fuzz")]
    tasks: list[Awaitable[object]] = [
        _lane(kind, port, random.Random(rng.getrandbits(64)), tally, deadline) for kind, n in lanes for _ in range(n)
    ]
    if kinds["fuzz"]:
        tasks.append(fuzz(port, rng.getrandbits(64), args.seconds, kinds["fuzz"], tally.report))
    tasks.append(_sample_rss(pid, rss, deadline))
    try:
        async with asyncio.timeout(args.seconds + GRACE_S):
            await asyncio.gather(*tasks)
    except TimeoutError:
        tally.report.failures.append(f"clients still busy {GRACE_S:.0f} s after the end; cut off")
    if kinds["fuzz"]:
        closes = tally.report.closes  # fuzz's own tally of how its connections ended
        tally.opened["fuzz"] = closes.total()
        tally.ended["fuzz:by_server"] = closes["closed_by_server"]
        tally.ended["fuzz:by_client"] = closes.total() - closes["closed_by_server"]
    return tally


def governor_limits(args: argparse.Namespace) -> list[str]:
    """The LIMITS flags with their values (0 = the governor's default)."""
    flags: list[str] = []
    for flag in LIMITS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            flags += [flag, str(value)]
    return flags


def build_report(
    args: argparse.Namespace, flags: list[str], tally: Tally, snapshot: dict[str, Any], rss: list[float], alive: bool
) -> dict[str, Any]:
    settled = sum(snapshot.get(f"{k}_total", 0) for k in ("executed", "yielded", "rejected", "failed"))
    balanced = bool(snapshot) and snapshot["received_total"] == settled + snapshot["inflight"]
    latency = Distribution.of(tally.latencies_ms)
    leaked = snapshot.get("inflight")
    report = {
        "seconds": args.seconds,
        "seed": args.seed,
        "governor_flags": flags,
        "frames_sent": dict(sorted(tally.report.sent.items())),
        "replies": dict(sorted(tally.report.replies.items())),
        "connections": {
            kind: {
                "opened": opened,
                "closed_by_server": tally.ended[f"{kind}:by_server"],
                "closed_by_client": tally.ended[f"{kind}:by_client"],
            }
            for kind, opened in sorted(tally.opened.items())
        },
        "slots_leaked": leaked,
        "balanced": balanced,
        "server": {k: v for k, v in snapshot.items() if k.endswith(("_total", "_by_reason", "_shed"))},
        "rss_mib": {"start": rss[0], "max": max(rss), "end": rss[-1], "samples": rss} if rss else None,
        "well_behaved": {
            "completed": latency.count,
            "retries": tally.retries,
            "latency_p50_ms": latency.p50,
            "latency_p99_ms": latency.p99,
        },
        "governor_alive": alive,
        "failures": tally.report.failures,
    }
    report["ok"] = leaked == 0 and balanced and alive and latency.count > 0 and not tally.report.failures
    return report


def record(sitting: Sitting, report: dict[str, Any], snapshot: dict[str, Any]) -> None:
    """The report's figures: no slot leaked and how far RSS grew say the governor held; the rest say
    what it held against and how the well-behaved clients fared meanwhile."""
    leaked, rss, wb, failures = report["slots_leaked"], report["rss_mib"], report["well_behaved"], report["failures"]
    growth = rss["end"] - rss["start"] if rss else None
    executed = snapshot.get("executed_total")
    off = imbalance(snapshot)
    sitting.figure("slots leaked", leaked, "slots", bar="0", met=leaked == 0)
    sitting.figure(
        "governor RSS growth",
        growth,
        "MiB",
        note=f"{rss['start']:.1f} MiB at start, {rss['end']:.1f} at the end, {rss['max']:.1f} at most"
        if rss
        else "not sampled",
    )
    sitting.figure(
        "RSS growth per executed request",
        growth * 2**20 / executed if growth is not None and executed else None,
        "bytes",
        headline=False,
    )
    sitting.figure("counter imbalance", off, "frames", bar="0", met=off == 0, headline=False)
    sitting.figure(
        "violations found",
        len(failures),
        "failures",
        bar="0",
        met=not failures,
        headline=False,
        note="bad replies, unanswered requests, unbalanced counters, a dead or unreachable governor",
    )
    done = wb["completed"]
    sitting.figure("well-behaved requests completed", done, "requests", bar="> 0", met=done > 0, headline=False)
    sitting.figure("well-behaved latency p50", wb["latency_p50_ms"], "ms", headline=False)
    sitting.figure("well-behaved latency p99", wb["latency_p99_ms"], "ms", headline=False)
    sitting.figure("frames sent", sum(report["frames_sent"].values()), "frames", headline=False)
    opened = sum(c["opened"] for c in report["connections"].values())
    sitting.figure("connections opened", opened, "connections", headline=False)
    sitting.details = {**report, "failures": failures[:20]}


def render(report: dict[str, Any]) -> str:
    def pairs(d: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in d.items())

    rss = report["rss_mib"] or {"start": None, "max": None, "end": None}
    wb = report["well_behaved"]
    ms = {k: "-" if v is None else f"{v:.1f}" for k, v in wb.items() if k.endswith("_ms")}
    lines = [
        f"duration: {report['seconds']:.0f} s, seed {report['seed']}",
        f"governor flags: {' '.join(report['governor_flags'])}",
        f"frames sent ({sum(report['frames_sent'].values())}): {pairs(report['frames_sent'])}",
        f"replies ({sum(report['replies'].values())}): {pairs(report['replies'])}",
        "connections (opened / closed by server / closed by client):",
        *(
            f"  {kind}: {c['opened']} / {c['closed_by_server']} / {c['closed_by_client']}"
            for kind, c in report["connections"].items()
        ),
        f"server: {pairs({k: v for k, v in report['server'].items() if k.endswith('_total')})}",
        *(
            f"  {k}: {pairs({r: n for r, n in v.items() if n})}"
            for k, v in report["server"].items()
            if isinstance(v, dict)
        ),
        f"slots leaked: {report['slots_leaked']}",
        "balance (received == executed + yielded + rejected + failed + inflight): "
        + ("OK" if report["balanced"] else "FAIL"),
        f"governor RSS MiB: start {rss['start']:.1f}, max {rss['max']:.1f}, end {rss['end']:.1f}"
        if report["rss_mib"]
        else "governor RSS: not sampled",
        f"well-behaved: {wb['completed']} completed, {wb['retries']} retries after yield, "
        f"latency p50 {ms['latency_p50_ms']} ms, p99 {ms['latency_p99_ms']} ms",
        f"governor alive: {report['governor_alive']}",
        f"result: {'OK' if report['ok'] else 'FAIL'} ({len(report['failures'])} protocol failures)",
        *(f"  failure: {f}" for f in report["failures"][:20]),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--valid-clients", type=int, default=4)
    parser.add_argument("--hostile-connections", type=int, default=100)
    parser.add_argument("--max-inflight", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the report here")
    for flag, (kind, default, why) in LIMITS.items():
        parser.add_argument(flag, type=kind, default=default, help=f"passed when the governor knows it: {why}")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    flags = [
        "--max-inflight", str(args.max_inflight), "--max-frame-bytes", str(MAX_FRAME_BYTES),
        "--max-new-tokens-limit", str(MAX_NEW_TOKENS_LIMIT), *governor_limits(args),
    ]  # fmt: skip
    proc, port = start_governor(*flags, worker_args=WORKER_ARGS)
    rss: list[float] = []
    snapshot: dict[str, Any] = {}
    try:
        tally = asyncio.run(soak(port, proc.pid, args, rss))
        try:
            snapshot = check_server(port, tally.report, lambda: proc.poll() is None)
            rss.append(rss_mib(proc.pid))
        except OSError as exc:
            tally.report.failures.append(f"governor unreachable after the run: {exc!r}")
        alive = proc.poll() is None
    finally:
        stop(proc)
    report = build_report(args, flags, tally, snapshot, rss, alive)
    print(render(report))
    if args.json:
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    record(sitting, report, snapshot)
    sitting.write()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
