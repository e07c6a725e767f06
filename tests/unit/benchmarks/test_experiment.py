"""benchmarks/harness/experiment.py: what one arrival's client does with yields, errors and tokens,
and what a run reports; against a scripted client (the real one is driven by the benchmarks)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from benchmarks.harness.experiment import Arrival, Outcome, Run, poisson, send, ttft_ms
from governor.client import Yielded
from govwire.errors import InternalError


class Scripted:
    """A client whose attempts go as scripted: an exception to raise, or a number of tokens."""

    def __init__(self, *attempts: Exception | int) -> None:
        self.attempts = list(attempts)
        self.calls: list[dict[str, Any]] = []

    @asynccontextmanager
    async def stream(self, prompt: str, **fields: Any) -> AsyncIterator[AsyncIterator[str]]:
        self.calls.append({"prompt": prompt, **fields})
        step = self.attempts.pop(0)
        if isinstance(step, Exception):
            raise step

        async def tokens() -> AsyncIterator[str]:
            for _ in range(step):
                yield "t"

        yield tokens()


def run(client: Scripted, arrival: Arrival, **options: Any) -> Outcome:
    return asyncio.run(send(client, arrival, time.perf_counter(), **options))  # type: ignore[arg-type]


def yielded(reason: str, hint_ms: int = 1, ticket: str | None = None) -> Yielded:
    return Yielded("r", hint_ms, reason, ticket)


def test_a_yield_is_final_unless_retries_are_asked_for() -> None:
    out = run(Scripted(yielded("inflight")), Arrival(0.0, "hi", tenant="A"))
    assert (out.status, out.code, out.attempts, out.reasons, out.ttft_s) == (
        "yield",
        "inflight",
        1,
        ("inflight",),
        None,
    )


def test_a_retry_sends_the_ticket_back_and_the_ttft_counts_from_the_first_attempt() -> None:
    client = Scripted(yielded("inflight", 30, ticket="t1"), 3)
    out = run(client, Arrival(0.0, "hi", priority="critical"), retry_until=1e18)
    assert (out.status, out.attempts, out.reasons) == ("done", 2, ("inflight",))
    assert out.ttft_s is not None and out.ttft_s >= 0.03, "the hint's wait is part of the TTFT"
    assert [c["retry_ticket"] for c in client.calls] == [None, "t1"]
    assert client.calls[0]["priority"] == "critical" and client.calls[0]["tenant"] is None
    assert client.calls[0]["temperature"] == 0.0 and client.calls[0]["stop_on_eos"] is False


def test_a_final_yield_is_not_retried_and_the_admitted_attempt_is_timed() -> None:
    final = Yielded("r", 10_000, "inflight", None, final=True)
    out = run(Scripted(final, 1), Arrival(0.0, "hi"), retry_until=1e18)
    assert (out.status, out.attempts, out.final) == ("yield", 1, True), "told not to come back: it does not"
    out = run(Scripted(yielded("inflight", 30, ticket="t"), 1), Arrival(0.0, "hi"), retry_until=1e18)
    assert out.admitted_s is not None and out.added_wait_s is not None and out.added_wait_s >= 0.03
    assert out.ended_s is not None and out.ended_s >= out.admitted_s
    assert out.first_token_within(10.0) and not out.first_token_within(0.0)


def test_a_preempted_request_is_retried_until_its_own_horizon() -> None:
    client = Scripted(yielded("preempted"), yielded("inflight"), 1)
    out = run(client, Arrival(0.0, "hi"), victim_until=1e18)  # retry_until None: other yields are final...
    assert (out.status, out.attempts) == ("done", 3), "...but once preempted, the client keeps retrying"
    out = run(Scripted(yielded("inflight"), 1), Arrival(0.0, "hi"), victim_until=1e18)
    assert out.status == "yield"


def test_no_retry_starts_past_the_horizon() -> None:
    out = run(Scripted(yielded("inflight", hint_ms=60_000), 1), Arrival(0.0, "hi"), retry_until=0.0)
    assert (out.status, out.attempts) == ("yield", 1)


def test_an_error_ends_the_arrival_with_its_code_and_a_deadline_is_sent() -> None:
    client = Scripted(InternalError("boom"))
    out = run(client, Arrival(0.0, "hi"), deadline_ms=250.0)
    assert (out.status, out.code) == ("error", "internal")
    assert client.calls[0]["deadline_ms"] == 250.0
    plain = Scripted(1)
    run(plain, Arrival(0.0, "hi"))
    assert "deadline_ms" not in plain.calls[0], "no deadline unless asked"


def outcome(kind: str, status: str, ttft_s: float | None, sent_s: float = 0.0) -> Outcome:
    return Outcome(Arrival(sent_s, "p", kind=kind), status, None, 1, ttft_s, sent_s)


def test_a_run_reports_quantiles_goodput_and_counts() -> None:
    outcomes = [outcome("short", "done", t / 100, sent_s=t) for t in range(1, 11)]
    outcomes += [outcome("long", "done", 2.0, 5.0), outcome("short", "yield", None), outcome("long", "error", None)]
    run_ = Run("r", outcomes, wall_s=2.0)
    assert run_.ttft_ms(0.5, "short") == pytest.approx(55.0)  # between the 5th and 6th of 10..100 ms
    assert run_.ttft_ms(0.99, "short") == pytest.approx(99.1)  # interpolated, not the maximum
    assert run_.ttft_ms(0.99, "short", since=3, until=5) == pytest.approx(39.9)
    assert run_.rps == 11 / 2.0 and run_.goodput(slo_s=0.05) == 5 / 2.0
    assert (run_.count("yield"), run_.count("error"), len(run_.done("long"))) == (1, 1, 1)
    assert ttft_ms([], 0.99) is None


def test_poisson_arrivals_are_seeded_and_within_the_window() -> None:
    times = poisson(50.0, 10.0, random.Random(1))
    assert times == poisson(50.0, 10.0, random.Random(1))
    assert times == sorted(times) and 0 < times[0] and times[-1] < 10.0
    assert 400 < len(times) < 600
