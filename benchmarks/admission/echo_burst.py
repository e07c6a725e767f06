"""Do refused clients that come back exactly at their hint get in? The lobby, measured.

A governor with `--max-inflight 8` in front of its echo worker answering one token every
`--token-delay-ms` (10 ms). Eight warm requests of 40 tokens are admitted and streaming; then a
burst of 64 requests, each of 4 or 40 tokens (seeded), is sent at once on one NDJSON connection.
Each one refused with a promise comes back **once**, exactly at its `retry_hint_ms` (the same id
and prompt, as a client that knows nothing of tickets re-sends it): it should be admitted then,
after at most a short wait in the lobby while its slot frees. A `final` refusal (past the promise
horizon) is not retried, as a client must not, and is counted apart.

Per round (a fresh governor each): admitted on their return (bar >= 99%, the lobby wait
included), the lobby wait a returning client saw, from its return to its `accepted` (bar: p99 <=
one token interval), how late its return was sent after its hint (the client's own timer: what
the governor cannot help), how many of the burst were admitted at once, refused with a promise,
and refused for good. Medians over `--rounds`. The issue's scenario runs the default horizon
(1000 ms): `--horizon-ms` sets another.

    python -m benchmarks.admission.echo_burst [--rounds 3] [--burst 64] [--token-delay-ms 10] [--horizon-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.common import machine, markdown_table, ndjson_replies, out_dir, start_governor, stats, stop
from benchmarks.harness.results import Sitting
from governor.bench.stats import percentile
from govwire.codec import encode, generate_frame

WARM = 8
"""Requests of `LONG` tokens admitted and streaming before the burst (the cap's 8 slots)."""
SHORT, LONG = 4, 40


@dataclass
class Round:
    admitted_first: int = 0
    promised: int = 0  # refused with an appointment (retried at the hint)
    final_first: int = 0  # refused for good at once (not retried)
    returned_admitted: int = 0
    returned_refused: int = 0
    returned_final: int = 0
    lobby_wait_ms: list[float] = field(default_factory=list)  # return sent -> accepted
    return_late_ms: list[float] = field(default_factory=list)  # return sent - hint due
    hints_ms: list[int] = field(default_factory=list)
    server_lobby_answered: int = 0

    @property
    def admitted_share(self) -> float | None:
        return self.returned_admitted / self.promised if self.promised else None


async def one_round(port: int, burst: int, seed: int) -> Round:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    loop = asyncio.get_running_loop()
    result = Round()
    rng = random.Random(seed)
    lengths = {f"b{i}": rng.choice((SHORT, LONG)) for i in range(burst)}
    lengths |= {f"w{i}": LONG for i in range(WARM)}
    state: dict[str, str] = {}  # id -> warm | first | waiting | returned | accepted | done
    returned_at: dict[str, float] = {}
    all_done = asyncio.Event()
    warm_started = asyncio.Event()

    def send(rid: str) -> None:
        writer.write(encode(generate_frame(rid, "p-" + rid, max_new_tokens=lengths[rid], ack=True)))

    def come_back(rid: str, due: float) -> None:
        now = time.monotonic()
        result.return_late_ms.append((now - due) * 1000.0)
        state[rid] = "returned"
        returned_at[rid] = now
        send(rid)

    def settle(rid: str) -> None:
        state[rid] = "done"
        if all(s == "done" for s in state.values()):
            all_done.set()

    async def read() -> None:
        async for now, reply in ndjson_replies(reader):
            rid, status = reply.get("id"), reply["status"]
            phase = state.get(rid) if isinstance(rid, str) else None
            if phase is None:
                continue
            if status == "token" and phase == "warm":
                state[rid] = "warm-streaming"
                if sum(s == "warm-streaming" for s in state.values()) == WARM:
                    warm_started.set()
            elif status == "accepted":
                if phase == "first":
                    result.admitted_first += 1
                elif phase == "returned":
                    result.returned_admitted += 1
                    result.lobby_wait_ms.append((now - returned_at[rid]) * 1000.0)
                if phase in ("first", "returned"):
                    state[rid] = "accepted"
            elif status == "yield":
                if phase == "first" and reply.get("final"):
                    result.final_first += 1
                    settle(rid)
                elif phase == "first":
                    result.promised += 1
                    hint = reply["retry_hint_ms"]
                    result.hints_ms.append(hint)
                    state[rid] = "waiting"
                    due = now + hint / 1000.0
                    loop.call_at(loop.time() + hint / 1000.0, come_back, rid, due)
                else:
                    result.returned_refused += 1
                    result.returned_final += bool(reply.get("final"))
                    settle(rid)
            elif status in ("done", "error"):
                settle(rid)

    reading = asyncio.create_task(read())
    for i in range(WARM):
        state[f"w{i}"] = "warm"
        send(f"w{i}")
    await asyncio.wait_for(warm_started.wait(), 10)
    for i in range(burst):
        state[f"b{i}"] = "first"
    writer.write(
        b"".join(
            encode(generate_frame(f"b{i}", f"p-b{i}", max_new_tokens=lengths[f"b{i}"], ack=True)) for i in range(burst)
        )
    )
    await asyncio.wait_for(all_done.wait(), 60)
    reading.cancel()
    writer.close()
    return result


def run(args: argparse.Namespace) -> list[Round]:
    rounds = []
    for r in range(args.rounds):
        proc, port = start_governor(
            "--max-inflight",
            "8",
            "--promise-horizon-ms",
            str(args.horizon_ms),
            worker_args=("--token-delay-ms", str(args.token_delay_ms)),
            log=out_dir() / "echo_burst.log",
        )
        try:
            result = asyncio.run(one_round(port, args.burst, seed=r))
            result.server_lobby_answered = stats(port)["lobby"]["answered_total"]
        finally:
            stop(proc)
        rounds.append(result)
        print(row(r + 1, result), flush=True)
    return rounds


def _p(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


def row(label: object, r: Round) -> list[str]:
    share = r.admitted_share
    wait50, wait99 = _p(r.lobby_wait_ms, 50), _p(r.lobby_wait_ms, 99)
    late99 = _p(r.return_late_ms, 99)
    return [
        str(label),
        str(r.admitted_first),
        str(r.promised),
        str(r.final_first),
        f"{r.returned_admitted}/{r.promised}" + ("" if share is None else f" = {share:.1%}"),
        f"{r.returned_refused} ({r.returned_final} final)",
        "-" if wait99 is None else f"{wait50:.1f} / {wait99:.1f}",
        "-" if late99 is None else f"{late99:.2f}",
        str(r.server_lobby_answered),
    ]


def record(sitting: Sitting, rounds: list[Round], args: argparse.Namespace) -> None:
    def median(pick: Any) -> float | None:
        values = [v for r in rounds if (v := pick(r)) is not None]
        return statistics.median(values) if values else None

    share = median(lambda r: r.admitted_share)
    sitting.figure(
        "returning clients admitted on their return (lobby wait included)",
        None if share is None else 100.0 * share,
        "%",
        bar=">= 99%",
        met=share is not None and share >= 0.99,
    )
    wait99 = median(lambda r: _p(r.lobby_wait_ms, 99))
    sitting.figure(
        "lobby wait p99 of a returning client (return sent -> accepted)",
        wait99,
        "ms",
        bar=f"<= {args.token_delay_ms:g} ms (one token interval)",
        met=wait99 is not None and wait99 <= args.token_delay_ms,
    )
    sitting.figure(
        "returns sent after their hint, p99 (the client's timer)",
        median(lambda r: _p(r.return_late_ms, 99)),
        "ms",
        headline=False,
    )
    for name, pick in (
        ("admitted at once", lambda r: r.admitted_first),
        ("refused with a promise", lambda r: r.promised),
        ("refused for good at once", lambda r: r.final_first),
    ):
        sitting.figure(f"of the burst of {args.burst}: {name}", median(pick), "requests", headline=False)
    sitting.details = {"rounds": [vars(r) for r in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="the echo worker's time between tokens")
    parser.add_argument("--horizon-ms", type=float, default=1000.0, help="the governor's --promise-horizon-ms")
    args = parser.parse_args()
    sitting = Sitting(
        ("govwire", "governor"), part=None if args.horizon_ms == 1000.0 else f"horizon-{args.horizon_ms:g}"
    )
    rounds = run(args)
    print(f"\nmachine: {machine()}\n")
    headers = ["round", "admitted at once", "promised", "final at once", "admitted on return", "refused on return"]
    headers += ["lobby wait p50 / p99 (ms)", "return late p99 (ms)", "lobby answers (server)"]
    print(markdown_table(headers, [row(i + 1, r) for i, r in enumerate(rounds)]))
    record(sitting, rounds, args)
    sitting.write()


if __name__ == "__main__":
    main()
