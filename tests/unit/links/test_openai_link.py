"""OpenAILink against a fake upstream (httpx.MockTransport): what each server answer becomes.
The real server (`transformers serve`) is in tests/integration/test_openai_upstream.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from governor.admission.endpoint import Endpoint, EndpointLimits, OpenAITarget
from governor.admission.limits import Grant
from governor.lifecycle import InflightRequest
from governor.links.health import HealthPolicy
from governor.links.openai_link import OpenAILink
from governor.links.upstream import Upstream
from governor.state import ServerState
from govwire.codec import encode, generate_frame
from govwire.errors import GovernorError
from govwire.messages import Completion
from govwire.request import GenerateRequest, IntegrityMode
from govwire.vocab import FinishReason
from tests.fakes import FakeClock, make_ingress, make_state

Handler = Callable[[httpx.Request], Any]
SSE = {"content-type": "text/event-stream"}


class Recorder:
    """Stands for the lifecycle and for the request's owner: records what the link tells them.
    An ending forgets the request on the link, as the lifecycle's settle does."""

    def __init__(self, link: OpenAILink, uid: str) -> None:
        self.active: dict[str, InflightRequest] = {}
        self.events: list[tuple[str, Any]] = []
        self.ended = asyncio.Event()
        self._link, self._uid = link, uid

    def token(self, request: InflightRequest) -> None:
        request.tokens_seen += 1

    def send_text(self, request: InflightRequest, text: str) -> None:
        self.events.append(("token", text))

    def finish(self, request: InflightRequest, completion: Completion) -> None:
        self._end("done", completion)

    def fail(self, request: InflightRequest, error: GovernorError) -> None:
        self._end("error", error)

    def busy(self, request: InflightRequest, retry_hint_ms: int) -> None:
        self._end("busy", retry_hint_ms)

    def lose(self, request: InflightRequest, message: str) -> None:
        self._end("lost", message)

    def _end(self, kind: str, value: Any) -> None:
        self.events.append((kind, value))
        self._link.inflight.pop(self._uid, None)
        self.ended.set()

    def flush(self) -> None:
        pass


def sse(*events: str) -> bytes:
    return b"".join(b"data: " + e.encode() + b"\n\n" for e in events)


async def run(
    handler: Handler, generate: GenerateRequest, cancel_after_s: float | None = None
) -> tuple[Recorder, OpenAILink]:
    """Start a link on a mock transport, submit one request, wait for its final answer."""
    endpoint = Endpoint("e", EndpointLimits(), time.monotonic())

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        result = handler(request)
        return await result if asyncio.iscoroutine(result) else result  # type: ignore[no-any-return]

    link = OpenAILink(OpenAITarget("http://up/v1", "m"), endpoint, transport=httpx.MockTransport(route))
    health = asyncio.create_task(link.maintain(HealthPolicy(0.05, 1.0, 5.0)))
    for _ in range(100):
        if endpoint.up:
            break
        await asyncio.sleep(0.01)
    owner = Recorder(link, "u1")
    link.lifecycle = owner  # type: ignore[assignment]
    request = InflightRequest("c1", owner, Grant(), 0.0)
    link.submit("u1", request, generate)
    if cancel_after_s is not None:
        if cancel_after_s:  # else at once, before the request's task has taken a step
            await asyncio.sleep(cancel_after_s)
        link.cancel("u1")
    await asyncio.wait_for(owner.ended.wait(), 5)
    health.cancel()
    link.close()
    return owner, link


def test_chunks_become_tokens_and_the_usage_the_completion() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, "body": request.content})
        body = sse(
            '{"choices":[{"text":"He"}]}',
            '{"choices":[{"text":"llo"}]}',
            '{"choices":[{"text":"","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
            "[DONE]",
        )
        return httpx.Response(200, content=body, headers=SSE)

    owner, _ = asyncio.run(run(handler, GenerateRequest("c1", "hi", max_new_tokens=2)))
    assert seen[0]["path"] == "/v1/completions" and b'"max_tokens":2' in seen[0]["body"]
    assert owner.events[:2] == [("token", "He"), ("token", "llo")]
    kind, completion = owner.events[2]
    assert kind == "done" and completion.text == "Hello"
    assert (completion.prompt_tokens, completion.completion_tokens) == (3, 2)
    assert completion.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(("status", "headers", "hint"), [(429, {"retry-after-ms": "300"}, 300), (503, {}, 1000)])
def test_a_full_server_pauses_its_endpoint_and_the_request_is_busy(
    status: int, headers: dict[str, str], hint: int
) -> None:
    owner, link = asyncio.run(run(lambda r: httpx.Response(status, headers=headers), GenerateRequest("c1", "hi")))
    assert owner.events == [("busy", hint)]
    assert link.endpoint.paused_until > time.monotonic() - 1 and link.busy_total == 1


def test_a_refused_request_is_bad_frame_with_the_servers_words() -> None:
    owner, _ = asyncio.run(run(lambda r: httpx.Response(400, text="prompt too long"), GenerateRequest("c1", "hi")))
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "bad_frame" and "prompt too long" in error.message


def test_a_connection_that_fails_is_a_lost_worker_and_the_endpoint_goes_down() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    owner, link = asyncio.run(run(handler, GenerateRequest("c1", "hi")))
    ((kind, message),) = owner.events
    assert kind == "lost" and "ConnectError" in message
    assert link.last_error.startswith("ConnectError")


def test_a_malformed_stream_is_an_internal_error() -> None:
    owner, _ = asyncio.run(
        run(lambda r: httpx.Response(200, content=sse('{"error": "boom"}'), headers=SSE), GenerateRequest("c1", "x"))
    )
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "internal" and "boom" in error.message
    owner, _ = asyncio.run(run(lambda r: httpx.Response(200, json={"choices": []}), GenerateRequest("c1", "x")))
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "internal" and "text/event-stream" in error.message


def test_a_cancel_closes_the_stream_and_answers_cancelled() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            yield sse('{"choices":[{"text":"a"}]}')
            await asyncio.sleep(60)
        finally:
            closed.set()

    owner, _ = asyncio.run(
        run(
            lambda r: httpx.Response(200, content=endless(), headers=SSE),
            GenerateRequest("c1", "x"),
            cancel_after_s=0.1,
        )
    )
    assert owner.events[0] == ("token", "a")
    kind, completion = owner.events[-1]
    assert kind == "done" and completion.finish_reason is FinishReason.CANCELLED and completion.text == "a"
    assert closed.is_set()  # the stream was closed: the server sees the disconnect


def test_a_cancel_before_the_request_started_still_answers_cancelled() -> None:
    owner, link = asyncio.run(
        run(lambda r: httpx.Response(200, content=sse("[DONE]"), headers=SSE), GenerateRequest("c1", "x"), 0)
    )
    ((kind, completion),) = owner.events
    assert kind == "done" and completion.finish_reason is FinishReason.CANCELLED and completion.text == ""
    assert not link._tasks  # nothing left behind


def test_a_stream_cut_before_its_end_is_a_lost_worker() -> None:
    owner, _ = asyncio.run(
        run(
            lambda r: httpx.Response(200, content=sse('{"choices":[{"text":"a"}]}'), headers=SSE),
            GenerateRequest("c1", "x"),
        )
    )
    assert owner.events[0] == ("token", "a")
    kind, message = owner.events[-1]
    assert kind == "lost" and "without [DONE]" in message


def test_through_a_door_the_lifecycle_ends_the_request_and_the_link_forgets_it() -> None:
    """The whole path without sockets: the NDJSON door, admission, the lifecycle and this link."""
    body = sse(
        '{"choices":[{"text":"Hi"}]}',
        '{"choices":[{"text":"","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}',
        "[DONE]",
    )

    async def route(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"" if request.url.path == "/health" else body, headers=SSE)

    async def scenario() -> tuple[list[dict[str, Any]], ServerState, OpenAILink]:
        clock = FakeClock()
        endpoint = Endpoint("e", EndpointLimits(), clock())
        upstream = Upstream([(OpenAITarget("http://up/v1", "m"), endpoint)])
        link = upstream.links[0]
        assert isinstance(link, OpenAILink)
        link._transport = httpx.MockTransport(route)  # what OpenAILink(transport=...) sets
        state = make_state(upstream=upstream, endpoints=[endpoint], clock=clock, integrity=IntegrityMode.OFF)
        health = asyncio.create_task(link.maintain(HealthPolicy(0.05, 1.0, 5.0)))
        for _ in range(100):
            if endpoint.up:
                break
            await asyncio.sleep(0.01)
        ingress, writes = make_ingress(state)
        ingress.receive_data(encode(generate_frame("c", "hi", integrity=False)))
        for _ in range(500):
            if state.accounting.executed:
                break
            await asyncio.sleep(0.01)
        health.cancel()
        link.close()
        return [orjson.loads(line) for line in writes.lines()], state, link

    replies, state, link = asyncio.run(scenario())
    assert replies[0] == {"id": "c", "status": "token", "index": 0, "token_id": None, "text": "Hi"}
    assert (replies[1]["status"], replies[1]["text"], replies[1]["finish_reason"]) == ("done", "Hi", "eos")
    assert not link.inflight  # answered: the link holds it no more (settled, then forgotten)
    assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0
