"""Seeded raw-byte fuzzer against a real governor (issue 6: hostile and malformed input).

    python -m benchmarks.robustness.fuzz --seed 1 --seconds 10 [--connections 8]

Starts a governor with the echo worker on loopback, and from several connections sends a mix of
valid generate frames, mutated ones (byte flips, truncation, splicing, wrong-typed fields), random
bytes, over-size lines, NULs and CRLF endings, in random chunks; some connections are dropped
mid-stream. Then it checks what the protocol promises: the server never closes a connection on
its own, a connection that is drained gets exactly one final reply per line it sent, every reply
is valid JSON with a known status and code, the counters balance, no slot is left in flight and
the server is still alive and serving. Exits 1 on any failure. The result file holds the count of
failures (bar: 0) beside what was sent and checked.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from benchmarks.harness.common import start_governor, stop
from benchmarks.harness.results import Sitting
from governor.client import NO_RETRY, Client, GovernorError, Yielded
from govwire.codec import encode, generate_frame
from govwire.errors import ERRORS_BY_CODE
from govwire.vocab import FINAL_STATUSES, YieldReason

MAX_FRAME_BYTES = 128 * 1024  # above the 100k-deep nesting case, small enough to send many huge lines
GOVERNOR_FLAGS = ("--max-inflight", "4", "--max-frame-bytes", str(MAX_FRAME_BYTES), "--max-new-tokens-limit", "64")
WORKER_ARGS = ("--token-delay-ms", "1")  # requests stay in flight long enough to be yielded and cut off
KNOWN_STATUSES = {"accepted", "token", "pong", "stats", *FINAL_STATUSES}
ERROR_CODES = set(ERRORS_BY_CODE)  # every code a reply may carry, the shedding ones included
ANSWERED_STATUSES = FINAL_STATUSES | {"pong", "stats"}  # the one answer a line gets
ANSWER_TIMEOUT_S = 20.0  # a drained connection waits this long for its last answers


@dataclass
class Report:
    sent: Counter[str] = field(default_factory=Counter)  # frames by kind
    replies: Counter[str] = field(default_factory=Counter)  # by status, or error:code / yield:reason
    lines_sent: int = 0  # non-blank complete lines, i.e. frames the server must answer
    lines_drained: int = 0  # of those, on connections read until every answer arrived
    closes: Counter[str] = field(default_factory=Counter)  # drain / drop / half_close / closed_by_server
    failures: list[str] = field(default_factory=list)


# -- frame generators ----------------------------------------------------------------------------


def _prompt(rng: random.Random) -> str:
    alphabet = 'abcxyz ~\\"\n\té€𝄞\u2028'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))


def _valid(rng: random.Random, rid: str) -> bytes:
    return encode(
        generate_frame(
            rid,
            _prompt(rng),
            max_new_tokens=rng.randint(1, 8),
            ack=rng.random() < 0.3,
            stream=rng.random() < 0.7,
        )
    )


_HOSTILE_VALUES = [
    b"null", b"true", b"false", b"0", b"-1", b"65", b"1.5", b"1e400", b"-1e400", str(2**200).encode(),
    str(2**64).encode(), b'""', b'"x"', b"[]", b"{}", b'[[[[["deep"]]]]]', b'"' + b"z" * 300 + b'"',
    b'"\\u0000"', b'"\xff\xfe"', b'{"a":[1,{"b":null}]}',
]  # fmt: skip
_FIELDS = [
    "id", "op", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
    "stop_on_eos", "stream", "ack", "size", "sha256",
]  # fmt: skip


def _wrong_field(rng: random.Random, rid: str) -> bytes:
    frame = orjson.loads(_valid(rng, rid))
    name = rng.choice(_FIELDS)
    frame.pop(name, None)
    return orjson.dumps(frame)[:-1] + b',"' + name.encode() + b'":' + rng.choice(_HOSTILE_VALUES) + b"}\n"


def _byte_flips(rng: random.Random, rid: str) -> bytes:
    data = bytearray(_valid(rng, rid))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def _truncated(rng: random.Random, rid: str) -> bytes:
    data = _valid(rng, rid)
    return data[: rng.randrange(len(data))] + b"\n"


def _spliced(rng: random.Random, rid: str) -> bytes:
    a, b = _valid(rng, rid), _valid(rng, rid + "'")
    return a[: rng.randrange(len(a))] + b[rng.randrange(len(b)) :]


def _random_bytes(rng: random.Random, rid: str) -> bytes:
    return rng.randbytes(rng.randint(1, 300)) + b"\n"


def _huge(rng: random.Random, rid: str) -> bytes:
    # At the limit, just over it, or far over it; valid JSON padded with spaces or plain junk.
    size = rng.choice([MAX_FRAME_BYTES, MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES * 3])
    body = _valid(rng, rid).rstrip(b"\n") if rng.random() < 0.5 else b"#"
    return body + b" " * max(0, size - len(body)) + b"\n"


def _nested(rng: random.Random, rid: str) -> bytes:
    return rng.choice([b"[", b'{"a":', b'{"id":"' + rid.encode() + b'","prompt":']) * 20_000 + b"\n"


def _nul(rng: random.Random, rid: str) -> bytes:
    data = _valid(rng, rid)
    at = rng.randrange(len(data))
    return data[:at] + b"\x00" * rng.randint(1, 8) + data[at:]


def _crlf(rng: random.Random, rid: str) -> bytes:
    return _valid(rng, rid).replace(b"\n", b"\r\n")


def _duplicate(rng: random.Random, rid: str) -> bytes:
    return _valid(rng, rid) * 2


def _control(rng: random.Random, rid: str) -> bytes:
    op = rng.choice([b"ping", b"stats", b"reboot"])
    return b'{"id":"' + rid.encode() + b'","op":"' + op + b'"}\n'


def _blank(rng: random.Random, rid: str) -> bytes:
    return rng.choice([b"\n", b"\r\n"])


KINDS: dict[str, tuple[float, Callable[[random.Random, str], bytes]]] = {
    "valid": (30, _valid),
    "wrong_field": (12, _wrong_field),
    "byte_flips": (10, _byte_flips),
    "truncated": (6, _truncated),
    "spliced": (6, _spliced),
    "random": (6, _random_bytes),
    "huge": (2, _huge),
    "nested": (1, _nested),
    "nul": (5, _nul),
    "crlf": (8, _crlf),
    "duplicate": (5, _duplicate),
    "control": (4, _control),
    "blank": (3, _blank),
}


def answered_lines(stream: bytes) -> int:
    """Lines in `stream` the server must answer: complete, and neither empty nor a lone \\r."""
    return sum(line not in (b"", b"\r") for line in stream.split(b"\n")[:-1])


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0


def check_reply(line: bytes, report: Report) -> bool:
    """Tally one reply; False (and a failure noted) when it is not valid protocol."""
    try:
        reply = orjson.loads(line)
        status = reply["status"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        report.failures.append(f"malformed reply {line[:200]!r}")
        return False
    problem = ""
    if status not in KNOWN_STATUSES:
        problem = "unknown status"
    elif status == "error" and reply.get("code") not in ERROR_CODES:
        problem = "unknown error code"
    elif status == "yield" and (
        reply.get("reason") not in set(YieldReason) or not _positive_int(reply.get("retry_hint_ms"))
    ):
        problem = "bad yield"
    elif status == "error" and reply["code"] == "internal":
        problem = "internal error"
    if problem:
        report.failures.append(f"{problem}: {line[:200]!r}")
    detail = {"error": reply.get("code"), "yield": reply.get("reason")}.get(status)
    report.replies[status + (f":{detail}" if detail else "")] += 1
    return status in ANSWERED_STATUSES


# -- connections ---------------------------------------------------------------------------------


async def _read_replies(reader: asyncio.StreamReader, report: Report, answers: list[int]) -> None:
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                report.failures.append(f"reply cut off: {exc.partial[:200]!r}")
            return
        answers[0] += check_reply(line, report)


async def one_connection(port: int, rng: random.Random, deadline: float, report: Report, conn_no: int) -> None:
    """Send random frames until the deadline or a random end: drain and check, half-close, or drop."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    answers = [0]
    reading = asyncio.create_task(_read_replies(reader, report, answers))
    sent = bytearray()
    names = list(KINDS)
    weights = [w for w, _ in KINDS.values()]
    end = rng.choices(["drain", "drop", "half_close"], [6, 3, 1])[0]
    for _ in range(rng.randint(5, 150)):
        if time.monotonic() >= deadline:
            break
        kind = rng.choices(names, weights)[0]
        rid = f"c{conn_no}-{rng.randrange(12)}"  # a small id space: duplicates happen by chance too
        data = KINDS[kind][1](rng, rid)
        report.sent[kind] += 1
        sent += data
        while data:  # random chunks, so frames straddle reads
            cut = rng.randint(1, max(1, len(data)))
            writer.write(data[:cut])
            data = data[cut:]
            if rng.random() < 0.2:
                await writer.drain()
        await writer.drain()
        if reading.done():
            report.failures.append("server closed a connection by itself")
            report.closes["closed_by_server"] += 1
            writer.close()
            return
    if end == "drain":
        sent += b"\n"  # ends an unterminated tail, which then must be answered too
        writer.write(b"\n")
        await writer.drain()
        expected = answered_lines(bytes(sent))
        report.lines_sent += expected
        report.lines_drained += expected
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                while answers[0] < expected and not reading.done():
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pass
        if answers[0] != expected:
            report.failures.append(f"connection {conn_no}: {answers[0]} answers for {expected} lines")
    else:
        report.lines_sent += answered_lines(bytes(sent))
        if end == "half_close":
            writer.write_eof()
    report.closes[end] += 1
    writer.close()
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)


async def fuzz(port: int, seed: int, seconds: float, connections: int, report: Report | None = None) -> Report:
    """Keep `connections` fuzzing connections open (each replaced when it ends) for `seconds`;
    tallied into `report` when given (a soak shares one with its other clients)."""
    report = Report() if report is None else report
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    counter = iter(range(1 << 62))

    async def lane() -> None:
        lane_rng = random.Random(rng.getrandbits(64))
        while time.monotonic() < deadline:
            try:
                await one_connection(port, lane_rng, deadline, report, next(counter))
            except OSError as exc:
                report.failures.append(f"connection error: {exc!r}")
                return

    await asyncio.gather(*(lane() for _ in range(connections)))
    return report


# -- the server's side ----------------------------------------------------------------------------


def stats(port: int) -> dict[str, Any]:
    with Client("127.0.0.1", port, timeout=10) as client:
        return client.stats()


def check_server(port: int, report: Report, alive: Callable[[], bool]) -> dict[str, Any]:
    """Settle, then check the counters, the slots and that a normal request still succeeds."""
    deadline = time.monotonic() + 10
    snapshot = stats(port)
    while snapshot["inflight"] and time.monotonic() < deadline:  # dropped connections settle at once
        time.sleep(0.05)
        snapshot = stats(port)
    if snapshot["inflight"]:
        report.failures.append(f"inflight is {snapshot['inflight']} after every connection closed")
    settled = sum(snapshot[f"{k}_total"] for k in ("executed", "yielded", "rejected", "failed"))
    if snapshot["received_total"] != settled + snapshot["inflight"]:
        report.failures.append(f"counters do not balance: {snapshot}")
    for outcome in ("yielded", "rejected", "failed"):
        if sum(snapshot[f"{outcome}_by_reason"].values()) != snapshot[f"{outcome}_total"]:
            report.failures.append(f"{outcome}_by_reason does not add up to {outcome}_total")
    # Control frames are not counted, so the server's total lies below every line sent, and above
    # the lines of drained connections that were answered as generate frames.
    counted_answers = report.lines_drained - report.replies["pong"] - report.replies["stats"]
    if not counted_answers <= snapshot["received_total"] <= report.lines_sent:
        report.failures.append(
            f"received_total {snapshot['received_total']} outside [{counted_answers}, {report.lines_sent}]"
        )
    try:
        with Client("127.0.0.1", port, timeout=10, retry=NO_RETRY) as client:
            text = client.generate("still serving", max_new_tokens=64).text
    except (OSError, GovernorError, Yielded) as exc:
        text = repr(exc)
    if text != "still serving":
        report.failures.append(f"a normal generate after fuzzing got {text!r}")
    if not alive():
        report.failures.append("the governor process died")
    return snapshot


def imbalance(snapshot: dict[str, Any]) -> int | None:
    """received - (executed + yielded + rejected + failed + inflight): 0 when the counters balance,
    as a number so a result file says by how much they did not; None without a snapshot."""
    if not snapshot:
        return None
    settled = sum(snapshot[f"{k}_total"] for k in ("executed", "yielded", "rejected", "failed"))
    return int(snapshot["received_total"] - settled - snapshot["inflight"])


def record(sitting: Sitting, args: argparse.Namespace, report: Report, snapshot: dict[str, Any]) -> None:
    """The summary's figures: the failure count is the one that says the server held; the rest say
    how much it was put through."""
    failures, leaked, off = len(report.failures), snapshot["inflight"], imbalance(snapshot)
    sitting.figure(
        "violations found",
        failures,
        "failures",
        bar="0",
        met=failures == 0,
        note="bad replies, unanswered lines, server-side closes, unbalanced counters, a slot left, a dead server",
    )
    sitting.figure("frames sent", report.sent.total(), "frames", headline=False)
    sitting.figure("replies checked", report.replies.total(), "replies", headline=False)
    sitting.figure("connections opened", report.closes.total(), "connections", headline=False)
    sitting.figure("slots left in flight", leaked, "slots", bar="0", met=leaked == 0, headline=False)
    sitting.figure("counter imbalance", off, "frames", bar="0", met=off == 0, headline=False)
    sitting.details = {
        "seconds": args.seconds,
        "seed": args.seed,
        "connections": args.connections,
        "frames_sent": dict(sorted(report.sent.items())),
        "replies": dict(sorted(report.replies.items())),
        "connection_ends": dict(sorted(report.closes.items())),
        "lines_sent": report.lines_sent,
        "lines_drained": report.lines_drained,
        "server": {k: v for k, v in snapshot.items() if k.endswith(("_total", "_by_reason")) or k == "inflight"},
        "failures": report.failures[:20],
    }


def summary(report: Report, snapshot: dict[str, Any]) -> str:
    def line(counter: Counter[str]) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(counter.items()))

    settled = sum(snapshot.get(f"{k}_total", 0) for k in ("executed", "yielded", "rejected", "failed"))
    balance = "OK" if snapshot.get("received_total") == settled + snapshot.get("inflight", -1) else "FAIL"
    return "\n".join(
        [
            f"frames sent ({sum(report.sent.values())}): {line(report.sent)}",
            f"replies ({sum(report.replies.values())}): {line(report.replies)}",
            f"connections: {line(report.closes)}",
            f"lines sent {report.lines_sent}, of them on drained connections {report.lines_drained}",
            "server: "
            + ", ".join(f"{k}={snapshot.get(k)}" for k in ("received_total", "executed_total", "yielded_total"))
            + ", "
            + ", ".join(f"{k}={snapshot.get(k)}" for k in ("rejected_total", "failed_total", "inflight")),
            f"balance: {balance}",
            f"result: {'FAIL' if report.failures else 'OK'} ({len(report.failures)} failures)",
            *(f"  failure: {f}" for f in report.failures[:20]),
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    proc, port = start_governor(*GOVERNOR_FLAGS, worker_args=WORKER_ARGS)
    try:
        report = asyncio.run(fuzz(port, args.seed, args.seconds, args.connections))
        snapshot = check_server(port, report, lambda: proc.poll() is None)
    finally:
        stop(proc)
    print(summary(report, snapshot))
    record(sitting, args, report, snapshot)
    sitting.write()
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
