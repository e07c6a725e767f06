"""The OpenAI-compatible front door (--http-port) with the real `openai` SDK, in front of a real
GPT-2 worker process; and what malformed HTTP gets."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from transformers import AutoTokenizer

from benchmarks.harness.fixtures.redis_server import free_port
from tests.integration.conftest import Governor
from tests.integration.test_gpt2_worker import gpt2_governor
from worker.tokenizer import default_chat_prompt

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]


def front_door(
    start_governor: Start, model_dir: Path | None, *flags: str, echo: tuple[str, ...] = ()
) -> tuple[Governor, int]:
    """A governor with the front door on a free port, spawning a GPT-2 worker on `model_dir` (or,
    with None, the echo engine with the `echo` flags)."""
    port = free_port()
    all_flags = ("--http-port", str(port), *flags)  # no integrity flag: the door's default serves the SDKs
    if model_dir is None:
        return start_governor(*all_flags, worker_args=echo), port
    return gpt2_governor(start_governor, model_dir, *all_flags), port


def sdk(port: int, **options: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", **options)  # type: ignore[arg-type]


def balanced(gov: Governor) -> None:
    """Every frame, from either front door, is accounted for once nothing is in flight."""
    s = gov.stats()
    settled = s["executed_total"] + s["yielded_total"] + s["rejected_total"] + s["failed_total"]
    assert s["received_total"] == settled + s["inflight"], s


def test_the_openai_sdk_streams_and_completes_through_the_gpt2_worker(
    start_governor: Start, tiny_gpt2_dir: Path
) -> None:
    gov, port = front_door(start_governor, tiny_gpt2_dir)
    with sdk(port) as client:
        assert [m.id for m in client.models.list().data] == ["gpt2"]
        whole = client.completions.create(model="gpt2", prompt="The quick brown fox", max_tokens=6, temperature=0)
        choice = whole.choices[0]
        assert whole.usage is not None and whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens > 0
        assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
        stream = client.completions.create(
            model="gpt2",
            prompt="The quick brown fox",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == choice.text  # greedy: the same tokens, streamed
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="settled")
        s = gov.stats()
        assert s["executed_total"] == 2 and s["received_by_protocol"] == {"ndjson": 0, "http": 2}
        balanced(gov)
        metrics = gov.metrics()
        assert metrics[("governor_protocol_received_total", (("protocol", "http"),))] == 2
        assert ("governor_protocol_connections", (("protocol", "http"),)) in metrics
        # Chat through the worker: the messages rendered by the tokenizer's chat template (GPT-2's
        # has none: the default one), whole and streamed, admitted and counted like completions.
        messages: list[Any] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]},
        ]
        chat = client.chat.completions.create(
            model="gpt2", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
        rendered = default_chat_prompt(plain)
        prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_gpt2_dir).encode(rendered, add_special_tokens=False))
        assert chat.usage is not None and chat.usage.prompt_tokens == prompt_tokens
        assert chat.usage.completion_tokens == 4 and chat.choices[0].message.role == "assistant"
        pieces = client.chat.completions.create(
            model="gpt2", messages=messages, max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="messages\\[0\\] must be"):
            client.chat.completions.create(model="gpt2", messages=[{"role": "robot", "content": "hi"}], max_tokens=2)
        gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="settled")
        assert gov.stats()["executed_total"] == 4
        balanced(gov)
    # The NDJSON port serves the same pool at the same time.
    c = gov.conn()
    c.send("n", "hello", max_new_tokens=2)
    assert c.until_final("n")[-1]["status"] == "done"


def test_a_yield_is_a_429_the_sdk_retries_after_the_hint(start_governor: Start) -> None:
    # Hints of about 200 ms: the SDK's 20 retries span ~4 s, the holder's 20 tokens 2 s.
    flags = ("--max-inflight", "1", "--retry-hint", "fixed", "--retry-hint-ms", "200")
    gov, port = front_door(start_governor, None, *flags, echo=("--token-delay-ms", "100"))
    holder_done = threading.Event()

    def hold() -> None:  # a streamed request holds the only slot for ~2 s
        with sdk(port, max_retries=0) as client:
            for _ in client.completions.create(model="gpt2", prompt="hold " * 20, max_tokens=20, stream=True):
                pass
        holder_done.set()

    holder = threading.Thread(target=hold)
    holder.start()
    gov.wait_until(lambda: gov.stats()["inflight"] == 1, what="the slot held")
    # Without retries: RateLimitError, carrying both headers and the reason.
    with sdk(port, max_retries=0) as client, pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model="gpt2", prompt="x", max_tokens=2)
    headers = refused.value.response.headers
    hint_ms = int(headers["retry-after-ms"])
    assert 1 <= hint_ms < 1000 and headers["retry-after"] == "1"  # whole seconds, rounded up
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"  # a gateway's word for it
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "inflight" and body["message"] == "yielded: inflight"
    # With the SDK's own retries (it reads retry-after-ms first), the request gets in once the
    # slot frees: the holder ends well within the SDK's retries.
    with sdk(port, max_retries=20) as client:
        retried = client.completions.create(model="gpt2", prompt="y", max_tokens=2)
    assert retried.choices[0].text is not None and retried.usage is not None
    holder.join(30)
    assert holder_done.is_set()
    s = gov.stats()
    assert s["yielded_by_reason"]["inflight"] >= 2  # the refused one, and at least one of the retries
    # The SDK says which attempt it is (x-stainless-retry-count): its retries are counted apart, the
    # one admitted among them; with fixed hints no appointment is booked, so every retry is blind.
    attempts = s["attempts"]
    assert attempts["retry"]["admitted"] == 1 and attempts["retry"]["yielded"] >= 1
    assert attempts["first"] == {"admitted": 1, "yielded": 2}  # the holder; x, and y before its retries
    assert s["attempts"]["blind_retry"] == attempts["retry"]
    balanced(gov)
    # The front door's own /metrics (where aiperf looks): the hints handed out, by reason.
    scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    (count,) = [
        line
        for line in scrape.text.splitlines()
        if line.startswith('governor_retry_hint_seconds_count{reason="inflight"}')
    ]
    assert float(count.split()[-1]) == s["yielded_by_reason"]["inflight"]
    assert 'governor_requests_total{answer="admitted",attempt="retry"} 1.0' in scrape.text


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes, read until the server closes (or the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def post(body: bytes, *headers: str, path: str = "/v1/completions", close: bool = True) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", f"content-length: {len(body)}", *headers]
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def digest(body: bytes) -> str:
    return "content-digest: sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"


def test_bad_http_gets_clear_statuses_and_nothing_leaks(start_governor: Start) -> None:
    gov, port = front_door(start_governor, None, "--max-frame-bytes", "4096", "--http-request-timeout-s", "1")
    ok = orjson.dumps({"model": "gpt2", "prompt": "hi", "max_tokens": 2})
    cases = {
        b"GARBAGE\r\n\r\n": 400,
        post(b"{not json"): 400,
        post(orjson.dumps({"model": "gpt2", "prompt": "hi", "n": 3})): 400,
        post(orjson.dumps({"model": "nope", "prompt": "hi"})): 400,
        post(b"x" * 5000): 413,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n": 413,
        post(ok, "content-digest: sha-256=:AAAA:"): 400,
        post(ok, "content-digest: sha-256=notbytes"): 400,
        post(ok, path="/v2/nothing"): 404,
        b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n": 405,
    }
    for request, expected in cases.items():
        reply = raw(port, request)
        assert status_of(reply) == expected, (request[:80], reply[:300])
        if expected >= 400 and b"\r\n\r\n" in reply:
            body = reply.split(b"\r\n\r\n", 1)[1]
            assert orjson.loads(body)["error"]["message"], reply
    # A right digest passes; the integrity code names a wrong one.
    good = raw(port, post(ok, digest(ok)))
    assert status_of(good) == 200, good[:300]
    wrong = raw(port, post(ok, digest(b"other")))
    assert status_of(wrong) == 400 and b'"code":"integrity"' in wrong
    # Slow headers: 408 after the request timeout, the connection closed.
    started = time.monotonic()
    slow = raw(port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n", timeout=10)
    assert status_of(slow) == 408 and time.monotonic() - started < 5
    # Pipelined: two good requests answered in order, then garbage gets its 400 and the close.
    pipelined = raw(port, post(ok, close=False) + post(ok, close=False) + b"\x00\x01garbage\r\n\r\n")
    assert [status_of(b"HTTP/1.1 " + part) for part in pipelined.split(b"HTTP/1.1 ")[1:]] == [200, 200, 400]
    # Keep-alive: many requests on one connection, through httpx.
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
        for _ in range(20):
            assert http.post("/v1/completions", content=ok).status_code == 200
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="settled")
    balanced(gov)
    s = gov.stats()
    assert s["rejected_by_reason"]["frame_too_large"] == 2 and s["rejected_by_reason"]["integrity"] == 2
    # Still serving NDJSON and HTTP.
    assert status_of(raw(port, post(ok))) == 200
    c = gov.conn()
    c.send("n", "hello", max_new_tokens=2)
    assert c.until_final("n")[-1]["status"] == "done"


def test_odd_bodies_get_a_4xx_naming_the_field_and_no_worker_is_blamed(start_governor: Start) -> None:
    gov, port = front_door(start_governor, None)
    ok = orjson.dumps({"model": "gpt2", "prompt": "hi", "max_tokens": 2})
    cases = [
        (post(orjson.dumps({"prompt": "hi"})), 400, "model"),
        (post(orjson.dumps({"model": "gpt2", "prompt": "hi", "max_tokens": -5})), 400, "max_tokens"),
        (post(orjson.dumps({"model": "gpt2", "prompt": "hi", "n": 3})), 400, "n"),
        (post(ok, "content-type: text/plain"), 415, None),
        (post(ok, "content-type: application/x-www-form-urlencoded"), 415, None),
        (post(ok, "x-big: " + "a" * 70_000), 431, None),
    ]
    for request, status, param in cases:
        reply = raw(port, request)
        error = orjson.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert status_of(reply) == status and error["type"] == "invalid_request_error", reply[:300]
        assert error["param"] == param and "None" not in error["message"], error
    # Expect: 100-continue is answered before the body is sent (curl waits a second for it).
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        head = post(ok, "expect: 100-continue").split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        sock.sendall(head)
        assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(ok)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="settled")
    balanced(gov)
    stats = gov.stats()
    (worker,) = stats["workers"]
    assert worker["failed"] == 0 and stats["failed_total"] == 0 and stats["rejected_total"] == len(cases)


def test_auth_maps_bearer_tokens_to_tenants_and_a_drain_is_503(start_governor: Start, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha secret-a\n")
    tokens.chmod(0o600)
    gov, port = front_door(start_governor, None, "--auth-token-file", str(tokens))
    gov.token = "secret-a"
    ok = orjson.dumps({"model": "gpt2", "prompt": "hi", "max_tokens": 2})
    assert status_of(raw(port, post(ok))) == 401
    assert status_of(raw(port, post(ok, "authorization: Bearer wrong"))) == 401
    assert status_of(raw(port, post(ok, "authorization: Bearer secret-a"))) == 200
    tenants = {t["name"]: t for t in gov.stats()["tenants"]}
    assert tenants["alpha"]["executed_total"] == 1


async def _hostile(port: int, seed: int, count: int) -> list[bytes]:
    """`count` connections, each sending a mutated (truncated, flipped, duplicated, interleaved)
    mix of valid requests, then reading until the server closes or 1 s of silence."""
    rng = random.Random(seed)
    valid = [
        post(orjson.dumps({"model": "gpt2", "prompt": "hi " * rng.randint(1, 50), "max_tokens": 3}), close=False),
        post(orjson.dumps({"model": "gpt2", "prompt": "s", "max_tokens": 3, "stream": True}), close=False),
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
    ]
    replies: list[bytes] = []

    async def one() -> None:
        data = bytearray(b"".join(rng.choice(valid) for _ in range(rng.randint(1, 6))))
        for _ in range(rng.randint(0, 4)):
            at = rng.randrange(len(data))
            choice = rng.random()
            if choice < 0.4:
                data[at] = rng.randrange(256)
            elif choice < 0.7:
                del data[at:]
                break
            else:
                data[at:at] = rng.randbytes(rng.randint(1, 40))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(bytes(data))
        chunks = []
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 1.0):
                chunks.append(chunk)
        except TimeoutError:
            pass
        writer.close()
        replies.append(b"".join(chunks))

    for start in range(0, count, 16):
        await asyncio.gather(*(one() for _ in range(min(16, count - start))))
    return replies


def test_hostile_http_leaves_the_counters_balanced_and_both_doors_serving(start_governor: Start) -> None:
    gov, port = front_door(start_governor, None, "--max-inflight", "4", echo=("--token-delay-ms", "2"))
    replies = asyncio.run(_hostile(port, seed=11, count=160))
    statuses = {status_of(r) for r in replies if r.startswith(b"HTTP/1.1 ")}
    assert statuses <= {200, 400, 404, 405, 413, 429, 431} and {200, 400} <= statuses, statuses
    assert all(r.startswith(b"HTTP/1.1 ") or r == b"" for r in replies)  # a response, or nothing (cut)
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="every request settled")
    balanced(gov)
    assert gov.proc.poll() is None
    assert status_of(raw(port, post(orjson.dumps({"model": "gpt2", "prompt": "ok", "max_tokens": 2})))) == 200
    c = gov.conn()
    c.send("after", "ok", max_new_tokens=8)
    assert c.until_final("after")[-1]["text"] == "ok"
