"""Token budgets and deadlines through a real governor and real worker processes on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness.fixtures.tiny_gpt2 import N_POSITIONS
from govwire.codec import encode, generate_frame
from tests.integration.conftest import Governor, Worker
from tests.integration.test_gpt2_worker import gpt2_governor, worker

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]
ECHO = ("--engine", "echo")


def test_a_request_larger_than_the_budget_is_an_error_and_the_connection_serves_on(start_governor: Start) -> None:
    gov = start_governor("--max-inflight-tokens", "64", worker_args=ECHO)
    c = gov.conn()
    c.send("big", "x" * 40, max_new_tokens=60)  # ~10 prompt tokens + 60 > 64
    (reply,) = c.until_final("big")
    assert (reply["status"], reply["code"]) == ("error", "over_budget")
    assert "--max-inflight-tokens of 64" in reply["message"]
    c.send("ok", "x" * 40, max_new_tokens=8)
    assert c.until_final("ok")[-1]["status"] == "done"
    stats = gov.stats()
    assert stats["rejected_by_reason"]["over_budget"] == 1 and stats["inflight_tokens"] == 0


def test_an_early_eos_returns_its_unused_tokens_at_once(start_governor: Start) -> None:
    # A bucket of 100 tokens refilling at 1/s: a request reserving 1 + 60 leaves 39, too few for
    # a second one, unless settlement gives back what the early end-of-sequence did not use.
    gov = start_governor("--max-tokens-per-s", "1", "--tokens-burst", "100", worker_args=ECHO)
    c = gov.conn()
    c.send("a", "abc", max_new_tokens=60)  # the echo stops after the prompt's 3 bytes
    done = c.until_final("a")[-1]
    assert (done["status"], done["prompt_tokens"], done["completion_tokens"]) == ("done", 3, 3)
    stats = gov.stats()
    assert stats["tokens_reserved_total"] == 61 and stats["tokens_settled_total"] == 6
    assert 94 <= stats["token_rate_tokens"] <= 96  # 100 - 6, plus a second's refill at most
    c.send("b", "abc", max_new_tokens=60)
    assert c.until_final("b")[-1]["status"] == "done"
    c.send("c", "abc", max_new_tokens=60, stop_on_eos=False)  # runs to 60: settles at 63
    assert c.until_final("c")[-1]["completion_tokens"] == 60
    c.send("d", "abc", max_new_tokens=60)
    (reply,) = c.until_final("d")
    assert (reply["status"], reply["reason"]) == ("yield", "token_rate")
    assert 20_000 <= reply["retry_hint_ms"] <= 40_000  # 100 - 6 - 6 - 63 + refill = ~27: 34 s to 61
    assert reply["final"] is True and "retry_ticket" not in reply  # past the promise horizon: nothing paid


def test_a_deadline_that_passes_before_the_first_token_cancels_in_the_worker(
    start_governor: Start, start_worker: Callable[..., Worker], tiny_gpt2_dir: Path
) -> None:
    # One batch slot: the second request waits in the worker behind the first, past its deadline.
    # Both go in one write, before any stream was seen there, and the endpoint claims a step of
    # 10 µs (`step_ms=0.01`, the release forecast's prior): the governor forecasts the first one's
    # end well inside the deadline, admits both, and must cut the second in the worker.
    model = ("--engine", "gpt2", "--model", str(tiny_gpt2_dir), "--device", "cpu", "--dtype", "float32")
    address = start_worker(*model, "--stats-interval-s", "0.1", "--max-batch-size", "1").address
    gov = start_governor("--integrity", "optional", "--worker", f"{address},step_ms=0.01")
    gov.wait_until(lambda: worker(gov, "max_running") == 1, what="the worker reported its batch of one")
    c = gov.conn()
    first_tokens = N_POSITIONS - 8
    c.send_raw(
        encode(generate_frame("first", "hello", max_new_tokens=first_tokens, stop_on_eos=False))
        + encode(generate_frame("late", "hello there", max_new_tokens=8, deadline_ms=30))
    )
    finals = c.finals(2)
    assert (finals["late"]["status"], finals["late"]["code"]) == ("error", "deadline_exceeded")
    assert finals["first"]["status"] == "done" and finals["first"]["completion_tokens"] == first_tokens
    gov.wait_until(lambda: worker(gov, "finished_total") == 2, what="the worker reported both requests finished")
    assert worker(gov, "generated_tokens_total") == first_tokens  # the cancelled one generated nothing
    assert worker(gov, "running") == 0 and worker(gov, "waiting") == 0
    assert worker(gov, "kv_cache_used_tokens") == 0
    stats = gov.stats()
    assert stats["inflight"] == 0 and stats["inflight_tokens"] == 0
    deadlines = stats["deadlines"]
    assert (deadlines["met"], deadlines["expired"]) == (0, 1) and stats["failed_by_reason"]["deadline_exceeded"] == 1
    assert (deadlines["covered"], deadlines["exceeded"], deadlines["coverage"]) == (0, 0, None)  # (too few samples)
    c.send("next", "hello", max_new_tokens=4, deadline_ms=5000)
    assert c.until_final("next")[-1]["status"] == "done"
    deadlines = gov.stats()["deadlines"]
    assert (deadlines["met"], deadlines["expired"]) == (1, 1)


def test_a_deadline_the_forecast_shows_cannot_be_met_is_refused_at_once(
    start_governor: Start, tiny_gpt2_dir: Path
) -> None:
    # Once the worker has said it runs one request at a time and the one running has shown its
    # pace, a request whose deadline passes before that one ends is refused, never sent.
    gov = gpt2_governor(
        start_governor, tiny_gpt2_dir, "--integrity", "optional", worker_flags=("--max-batch-size", "1")
    )
    gov.wait_until(lambda: worker(gov, "max_running") == 1, what="the worker reported its batch of one")
    c = gov.conn()
    first_tokens = N_POSITIONS - 8
    c.send("first", "hello", max_new_tokens=first_tokens, stop_on_eos=False)
    # Its own pace is known from tokens that arrived apart (a loaded machine may deliver the first
    # few in one read, which tells no pace): read until 4 came over at least 20 ms.
    assert c.recv()["status"] == "token"
    began, received = time.monotonic(), 1
    while received < 4 or time.monotonic() - began < 0.02:
        assert c.recv()["status"] == "token"
        received += 1
    c.send("late", "hello there", max_new_tokens=8, deadline_ms=1)
    (late,) = c.until_final("late")
    assert (late["status"], late["reason"]) == ("yield", "deadline") and late["retry_hint_ms"] >= 1
    assert c.until_final("first")[-1]["completion_tokens"] == first_tokens
    gov.wait_until(lambda: worker(gov, "finished_total") == 1, what="the worker reported the first finished")
    stats = gov.stats()
    assert stats["yielded_by_reason"]["deadline"] == 1 and stats["inflight"] == 0
