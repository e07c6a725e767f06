"""Displacement before the first token (governor/admission/displacement.py) through a real governor
and its real echo worker: a critical frame at the full cap takes the slot of a sheddable request
still waiting for its first token; the victim is cancelled in the worker, answered `preempted`
with a hint, and a client honouring the hint gets in, here the real OpenAI SDK at its defaults."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from benchmarks.harness.fixtures.redis_server import free_port
from benchmarks.harness.fixtures.tiny_gpt2 import N_POSITIONS
from tests.integration.conftest import Governor
from tests.integration.test_gpt2_worker import gpt2_governor, worker

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]


def test_a_critical_frame_displaces_a_sheddable_sdk_request_which_gets_in_on_its_retry(start_governor: Start) -> None:
    port = free_port()
    # Two slots; every request waits 400 ms in the worker for its first token.
    gov = start_governor(
        "--http-port", str(port), "--integrity", "optional", "--max-inflight", "2",
        worker_args=("--first-token-delay-ms", "400", "--token-delay-ms", "5"),
    )  # fmt: skip
    ndjson = gov.conn()
    ndjson.send("warm", "warm", max_new_tokens=4)  # one request ends first: the forecast knows the service time
    assert ndjson.until_final("warm")[-1]["status"] == "done"
    ndjson.send("s0", "first", max_new_tokens=4, priority="sheddable", ack=True)
    assert ndjson.recv() == {"id": "s0", "status": "accepted"}
    answers: list[str] = []
    errors: list[BaseException] = []

    def sheddable_sdk_request() -> None:  # the newest sheddable request: the one displaced
        try:
            with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=10.0) as client:
                done = client.completions.create(
                    model="gpt2", prompt="second", max_tokens=4, extra_body={"priority": "sheddable"}
                )
                answers.append(done.choices[0].text)
        except BaseException as exc:  # surfaced by the test thread
            errors.append(exc)

    sdk = threading.Thread(target=sheddable_sdk_request, daemon=True)
    sdk.start()
    gov.wait_until(lambda: gov.stats()["inflight"] == 2, what="both sheddable requests admitted")
    ndjson.send("c0", "urgent", max_new_tokens=4, priority="critical")
    critical = ndjson.until_final("c0")
    assert critical[-1]["status"] == "done" and critical[-1]["text"] == "urge"
    sdk.join(15)
    assert not errors, errors
    assert answers == ["seco"]  # displaced, told when to come back, and let in on the SDK's own retry
    assert ndjson.until_final("s0")[-1]["status"] == "done"  # the older sheddable one was left alone
    s = gov.stats()
    assert s["yielded_by_reason"]["preempted"] == 1 and s["executed_total"] == 4 and s["inflight"] == 0
    assert s["classes"]["sheddable"]["preempted_total"] == 1
    assert s["retry_hints"]["outcomes"]["inflight"].get("on_time") == 1, s["retry_hints"]
    metrics = gov.metrics()
    assert metrics[("governor_preempted_total", (("class", "sheddable"), ("tenant", "default")))] == 1


def test_a_victim_queued_in_the_gpt2_worker_is_cancelled_there_and_generates_nothing(
    start_governor: Start, tiny_gpt2_dir: Path
) -> None:
    # A batch of one: the first request runs, the second waits in the worker's queue (more in flight
    # than the batch, where displacement matters most) until a critical frame takes its slot.
    # A long horizon: the victim's promise is forecast from the first stream's pace, whose ~117
    # remaining tokens outlast the default 1 s on a loaded 2-core machine (a refusal past the
    # horizon is final and carries no ticket).
    gov = gpt2_governor(
        start_governor, tiny_gpt2_dir, "--integrity", "optional", "--max-inflight", "2",
        "--promise-horizon-ms", "30000", worker_flags=("--max-batch-size", "1"),
    )  # fmt: skip
    c = gov.conn()
    first_tokens = N_POSITIONS - 8
    c.send("first", "hello", max_new_tokens=first_tokens, stop_on_eos=False)
    for _ in range(3):  # its pace is known from its second token: the victim's hint is forecast from it
        assert c.recv()["status"] == "token"
    c.send("queued", "hello there", max_new_tokens=8, priority="sheddable", ack=True)
    c.send("critical", "hello again", max_new_tokens=8, priority="critical", stop_on_eos=False)
    finals = c.finals(3)
    assert finals["queued"]["status"] == "yield" and finals["queued"]["reason"] == "preempted", finals["queued"]
    assert isinstance(finals["queued"]["retry_ticket"], str) and finals["queued"]["retry_hint_ms"] >= 1
    assert finals["critical"]["status"] == "done" and finals["critical"]["completion_tokens"] == 8
    assert finals["first"]["status"] == "done" and finals["first"]["completion_tokens"] == first_tokens
    # The displaced one generated nothing (cancelled while queued, or before the worker queued it).
    gov.wait_until(
        lambda: worker(gov, "generated_tokens_total") == first_tokens + 8 and worker(gov, "finished_total") >= 2,
        what="the worker reported both requests that ran",
    )
    assert worker(gov, "running") == 0 and worker(gov, "waiting") == 0 and worker(gov, "kv_cache_used_tokens") == 0
    s = gov.stats()
    assert s["inflight"] == 0 and s["yielded_by_reason"]["preempted"] == 1 and s["executed_total"] == 2


def test_preempt_off_refuses_the_critical_frame_instead(start_governor: Start) -> None:
    gov = start_governor("--max-inflight", "1", "--preempt", "off", worker_args=("--first-token-delay-ms", "300"))
    c = gov.conn()
    c.send("s0", "first", max_new_tokens=2, priority="sheddable", ack=True)
    assert c.recv() == {"id": "s0", "status": "accepted"}
    c.send("c0", "urgent", max_new_tokens=2, priority="critical")
    (refused,) = c.until_final("c0")
    assert (refused["status"], refused["reason"]) == ("yield", "inflight")
    assert c.until_final("s0")[-1]["status"] == "done"
    assert gov.stats()["yielded_by_reason"]["preempted"] == 0
