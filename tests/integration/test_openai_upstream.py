"""The governor in front of a real third-party OpenAI-compatible server, `transformers serve`
(benchmarks/harness/fixtures/openai_server.py), as an `http://.../v1,model=...` endpoint: NDJSON and
HTTP clients get their tokens, the endpoint's cap holds at the server, and a killed server is a lost
worker that comes back."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from benchmarks.harness.fixtures.openai_server import RequestCountingRelay, TransformersServe
from benchmarks.harness.fixtures.redis_server import free_port
from tests.integration.conftest import Governor

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def served(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersServe]:
    """The tiny GPT-2, given a chat template (it has none) so that chat completions work too."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("tiny-gpt2-chat")
    shutil.copytree(tiny_gpt2_dir, model_dir, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    server = TransformersServe(model_dir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def relay(served: TransformersServe) -> Iterator[RequestCountingRelay]:
    counting = RequestCountingRelay(served.port)
    try:
        yield counting
    finally:
        counting.close()


def governor_in_front(
    start_governor: Start, base_url: str, model: str, cap: int, *flags: str, served_as: str = ""
) -> tuple[Governor, int]:
    http_port = free_port()
    endpoint = f"{base_url},model={model},concurrency={cap}" + (f",served_as={served_as}" if served_as else "")
    gov = start_governor(
        "--worker", endpoint, "--http-port", str(http_port), "--integrity", "optional",
        "--served-model", "unused", "--worker-ping-interval-s", "0.2", *flags,
    )  # fmt: skip
    return gov, http_port


def test_ndjson_and_openai_clients_get_tokens_and_the_cap_holds_at_the_server(
    start_governor: Start, served: TransformersServe, relay: RequestCountingRelay
) -> None:
    # Its model is a directory's path: front-door clients use the name `served_as` gives it.
    gov, http_port = governor_in_front(start_governor, relay.base_url(), served.model, 2, served_as="tiny-chat")
    c = gov.conn()
    c.send("one", "Hello there", max_new_tokens=8)
    replies = c.until_final("one")
    tokens, done = replies[:-1], replies[-1]
    assert done["status"] == "done", done
    assert done["completion_tokens"] == 8 and done["prompt_tokens"] > 0 and done["finish_reason"] == "length"
    assert tokens and "".join(t["text"] for t in tokens) == done["text"]
    assert all(t["status"] == "token" for t in tokens)
    # The OpenAI SDK through the front door, to the same server.
    with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        answer = client.completions.create(model="tiny-chat", prompt="Hello there", max_tokens=8)
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        assert answer.choices[0].text == done["text"]  # transformers serve decodes greedily
        streamed = client.completions.create(model="tiny-chat", prompt="Hello there", max_tokens=8, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == done["text"]
        # Chat, relayed as chat to the server (which applies its template), streamed and not.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6)  # type: ignore[arg-type]
        reply = chat.choices[0].message
        assert reply.role == "assistant" and reply.content and chat.usage is not None
        assert chat.usage.completion_tokens == 6
        pieces = client.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            max_tokens=6,
            stream=True,  # type: ignore[arg-type]
        )
        assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == reply.content
    # A burst of 16 at once: the server never holds more than the endpoint's cap of 2.
    burst = gov.conn()
    for i in range(16):
        burst.send(f"b{i}", f"burst {i}", max_new_tokens=16)
    finals = burst.finals(16)
    statuses = [r["status"] for r in finals.values()]
    assert statuses.count("done") >= 2 and set(statuses) <= {"done", "yield"}, finals
    assert all(r["reason"] == "endpoint_inflight" for r in finals.values() if r["status"] == "yield")
    assert relay.peak == 2 and relay.total >= 5  # and it was reached, (relay.peak, relay.total)
    # top_k has no OpenAI field: refused by name, the slot freed. (The burst's refused clients
    # hold appointments that keep the endpoint's slots for them a while: like any client, this one
    # comes back at its hint when it is told one.)
    for _ in range(20):
        c.send("k", "x", max_new_tokens=2, top_k=5)
        (refused,) = c.until_final("k")
        if refused["status"] != "yield":
            break
        time.sleep(min(refused["retry_hint_ms"], 1000) / 1000)  # (a final one: try again a second on)
    assert refused["code"] == "bad_frame" and "top_k" in refused["message"]
    assert gov.stats()["inflight"] == 0
    (worker,) = gov.stats()["workers"]
    assert worker["kind"] == "openai" and worker["model"] == served.model and worker["up"]
    # Probed as it came up, before any of the above (the relay's peak counts the probes too).
    assert worker["probe"]["outcome"] == "ok" and worker["probe"]["step_ms"] > 0, worker["probe"]["why"]


def test_a_killed_server_is_worker_lost_and_the_endpoint_comes_back(
    start_governor: Start, served: TransformersServe, relay: RequestCountingRelay
) -> None:
    gov, _ = governor_in_front(start_governor, relay.base_url(), served.model, 4)
    c = gov.conn()
    c.send("long", "A long story", max_new_tokens=100)
    first = c.recv()
    assert first["status"] == "token", first  # streaming has begun
    served.kill()
    rest = c.until_final("long")
    assert rest[-1]["status"] == "error" and rest[-1]["code"] == "worker_lost", rest[-1]
    gov.wait_until(lambda: not gov.stats()["workers"][0]["up"], what="the endpoint down")
    c.send("down", "x", max_new_tokens=2)
    (unavailable,) = c.until_final("down")
    assert unavailable["code"] == "worker_unavailable"
    served.restart()
    gov.wait_until(lambda: gov.stats()["workers"][0]["up"], timeout=15, what="the endpoint back up")
    c.send("back", "Hello", max_new_tokens=4)
    assert c.until_final("back")[-1]["status"] == "done"
    s = gov.stats()
    assert s["failed_by_reason"]["worker_lost"] == 1 and s["inflight"] == 0
    assert s["received_total"] == s["executed_total"] + s["yielded_total"] + s["rejected_total"] + s["failed_total"]
