"""A cold governor in front of a fast serial OpenAI-compatible server (a real one on loopback:
benchmarks/harness/fixtures/serial_openai.py, one request at a time, 3 ms a token): the endpoint
is probed before it takes traffic, and the first burst is told times from what the probe
measured, not from a 100 ms-a-token prior; clients that come back at their hints all get in.
(What it buys, against the server alone: benchmarks/peers/cold_burst.py.)"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from benchmarks.harness.fixtures.serial_openai import Pace, SerialOpenAI
from governor.links.endpoint_probe import PROBE_TOKENS
from tests.integration.conftest import Governor

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]
BURST = 16
TOKENS = 8


@pytest.fixture
def serial() -> Iterator[SerialOpenAI]:
    with SerialOpenAI(Pace(token_s=0.003, slots=1)) as server:
        yield server


def _client(gov: Governor, rid: str, hints: list[int]) -> dict[str, Any]:
    """One client on its own connection: sends, and while refused with a promise, sends the same
    id and prompt again (its appointment) when the hint says. Its final answer; its hints told."""
    conn = gov.conn()
    try:
        while True:
            conn.send(rid, f"request {rid}", max_new_tokens=TOKENS)
            final = conn.until_final(rid)[-1]
            if final["status"] != "yield" or final.get("final"):
                return final
            hints.append(final["retry_hint_ms"])
            time.sleep(final["retry_hint_ms"] / 1000)
    finally:
        conn.close()


def test_a_cold_burst_is_told_times_from_the_probe_and_every_return_gets_in(
    start_governor: Start, serial: SerialOpenAI
) -> None:
    gov = start_governor(
        "--worker", f"{serial.base_url},model=m,concurrency=2", "--max-inflight", "64",
        "--promise-horizon-ms", "60000", "--worker-ping-interval-s", "0.2",
    )  # fmt: skip
    (worker,) = gov.stats()["workers"]
    probe = worker["probe"]
    # Probed before any traffic: a lone probe, then two at once, the second queued behind the first.
    assert probe["outcome"] == "ok" and 1 <= probe["step_ms"] <= 30 and probe["batch"] == 1, probe
    assert serial.get("/stats") == {"completions": 3, "tokens": 3 * PROBE_TOKENS}  # the probes' cost, and no more
    hints: list[int] = []
    with ThreadPoolExecutor(BURST) as pool:
        finals = list(pool.map(lambda i: _client(gov, f"r{i}", hints), range(BURST)))
    assert [f["status"] for f in finals] == ["done"] * BURST, finals
    # A 100 ms-a-token prior tells the burst 0.8 s per pair of requests ahead (median ~3 s, measured
    # at 5d077d5); the probe's 3 ms, ~25 ms per request ahead. Generous: a loaded machine slows the
    # server, whose probe then says so.
    assert hints and statistics.median(hints) < 1000, sorted(hints)
    stats = gov.stats()
    outcomes = stats["retry_hints"]["outcomes"]
    assert stats["executed_total"] == BURST and not any(stats["final_by_reason"].values()), stats
    assert list(outcomes) == ["endpoint_inflight"] and list(outcomes["endpoint_inflight"]) == ["on_time"], outcomes
    assert outcomes["endpoint_inflight"]["on_time"] == len(hints)  # every promise kept: no one told again
