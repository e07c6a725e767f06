"""Hundreds of hostile connections held open must not slow a normal client down."""

from __future__ import annotations

import asyncio
import random
import resource
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from benchmarks.robustness.fuzz import check_server
from benchmarks.robustness.soak import Tally, generate, hold, open_connection
from tests.integration.conftest import Governor

pytestmark = pytest.mark.integration

HOSTILE = 500
HOSTILE_KINDS = ("slowloris", "idle", "unread")
ROUNDS = 30
PAUSE_S = 0.02  # between a normal client's requests, so its rounds interleave with the slowloris bytes


def _raise_fd_limit(needed: int) -> None:
    """Every connection is a descriptor here too; the governor raises its own limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"open-files hard limit {hard} < {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _latencies_ms(port: int, tally: Tally, label: str) -> list[float]:
    """Sequential generate round trips of one normal client; each must end with done."""
    reader, writer = await open_connection(port, small_buffers=False)
    latencies = []
    try:
        for i in range(ROUNDS):
            start = time.perf_counter()
            final = await generate(reader, writer, f"{label}{i}", tally, max_new_tokens=2)
            latencies.append((time.perf_counter() - start) * 1000)
            assert final["status"] == "done", final
            await asyncio.sleep(PAUSE_S)
    finally:
        writer.close()
    return latencies


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _scenario(gov: Governor, tally: Tally) -> tuple[list[float], list[float], dict[str, Any]]:
    baseline = await _latencies_ms(gov.port, tally, "base")
    forever = time.monotonic() + 3600  # held until cancelled
    hostile = [
        asyncio.create_task(hold(HOSTILE_KINDS[i % len(HOSTILE_KINDS)], gov.port, random.Random(i), tally, forever))
        for i in range(HOSTILE)
    ]

    async def all_open() -> bool:
        return tally.opened.total() >= HOSTILE

    async def quiet() -> bool:
        return int((await asyncio.to_thread(gov.stats))["inflight"]) == 0

    try:
        await _until(all_open, "the hostile connections to open")
        # Once the non-reading clients' bursts are through, what is measured is the held connections' cost.
        await _until(quiet, "inflight to reach 0")
        loaded = await _latencies_ms(gov.port, tally, "loaded")
        during = await asyncio.to_thread(gov.stats)
    finally:
        for task in hostile:
            task.cancel()
        await asyncio.gather(*hostile, return_exceptions=True)
    return baseline, loaded, during


def test_held_hostile_connections_leave_a_normal_clients_latency_alone(
    start_governor: Callable[..., Governor],
) -> None:
    _raise_fd_limit(HOSTILE + 200)
    gov = start_governor()
    tally = Tally()
    baseline, loaded, during = asyncio.run(_scenario(gov, tally))

    def figures(ms: list[float]) -> str:
        return f"median {statistics.median(ms):.2f} ms, p90 {statistics.quantiles(ms, n=10)[-1]:.2f} ms"

    seen = f"baseline {figures(baseline)}; with {HOSTILE} hostile connections {figures(loaded)}; {dict(tally.opened)}"
    assert during["connections"] > HOSTILE, seen  # they were all held while the normal client ran
    base = statistics.median(baseline)
    assert statistics.median(loaded) <= max(3 * base, base + 20), seen
    snapshot = check_server(gov.port, tally.report, lambda: gov.proc.poll() is None)
    assert not tally.report.failures, tally.report.failures
    assert snapshot["inflight"] == 0
