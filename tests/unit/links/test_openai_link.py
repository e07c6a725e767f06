"""OpenAILink against a scripted server on loopback (tests/scripted_http.py): what each server
answer becomes, well-formed or hostile. Its probes are off here (test_endpoint_probe.py has them).
The real server (`transformers serve`) is in tests/integration/test_openai_upstream.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

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
from tests.scripted_http import Received, ScriptedServer, plain_response, sse_response

Respond = Callable[[Received, asyncio.StreamWriter], Awaitable[bool | None]]
OK_CHUNKS = (
    '{"choices":[{"text":"He"}]}',
    '{"choices":[{"text":"llo"}]}',
    '{"choices":[{"text":"","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
    "[DONE]",
)


class Recorder:
    """Stands for the lifecycle and for the request's owner: records what the link tells them.
    An ending forgets the request on the link, as the lifecycle's settle does."""

    def __init__(self, link: OpenAILink, uid: str) -> None:
        self.active: dict[str, InflightRequest] = {}
        self.events: list[tuple[str, Any]] = []
        self.relayed: list[bytes] = []
        self.flushes = 0
        self.ended = asyncio.Event()
        self._link, self._uid = link, uid

    def token(self, request: InflightRequest) -> None:
        request.tokens_seen += 1

    def relay_event(self, request: InflightRequest, text: str, event: bytes, usage: bool, only_usage: bool) -> None:
        self.relayed.append(event)
        if text:
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
        self.flushes += 1


async def serve(respond: Respond) -> ScriptedServer:
    """A scripted server that is healthy at /health and answers everything else with `respond`."""

    async def route(request: Received, writer: asyncio.StreamWriter) -> bool | None:
        if request.path == "/health":
            writer.write(plain_response("200 OK", b"{}"))
            return None
        return await respond(request, writer)

    return await ScriptedServer(route).start()


async def started_link(
    base_url: str, health: HealthPolicy | None = None, clock: Callable[[], float] = time.monotonic
) -> tuple[OpenAILink, asyncio.Task[None]]:
    endpoint = Endpoint("e", EndpointLimits(), clock())
    link = OpenAILink(OpenAITarget(base_url, "m", probe=False), endpoint, clock)
    task = asyncio.create_task(link.maintain(health or HealthPolicy(0.05, 1.0, 5.0)))
    for _ in range(200):
        if endpoint.up:
            break
        await asyncio.sleep(0.01)
    return link, task


async def one_request(
    link: OpenAILink, generate: GenerateRequest, cancel_after_s: float | None = None, uid: str = "u1"
) -> Recorder:
    owner = Recorder(link, uid)
    link.lifecycle = owner  # type: ignore[assignment]
    request = InflightRequest("c1", owner, Grant(), 0.0)
    link.submit(uid, request, generate)
    if cancel_after_s is not None:
        if cancel_after_s:  # else at once, before a byte was answered
            await asyncio.sleep(cancel_after_s)
        link.cancel(uid)
    await asyncio.wait_for(owner.ended.wait(), 5)
    return owner


async def run(
    respond: Respond, generate: GenerateRequest, cancel_after_s: float | None = None
) -> tuple[Recorder, OpenAILink, ScriptedServer]:
    """Start a link on a scripted server, submit one request, wait for its final answer."""
    server = await serve(respond)
    link, task = await started_link(server.base_url)
    try:
        owner = await one_request(link, generate, cancel_after_s)
    finally:
        task.cancel()
        link.close()
        await server.close()
    return owner, link, server


def answer(data: bytes, keep: bool | None = None) -> Respond:
    async def respond(request: Received, writer: asyncio.StreamWriter) -> bool | None:
        writer.write(data)
        return keep

    return respond


def test_chunks_become_tokens_and_the_usage_the_completion() -> None:
    owner, _, server = asyncio.run(run(answer(sse_response(*OK_CHUNKS)), GenerateRequest("c1", "hi", max_new_tokens=2)))
    (sent,) = [r for r in server.received if r.path != "/health"]
    assert sent.method == "POST" and sent.path == "/v1/completions" and b'"max_tokens":2' in sent.body
    assert sent.headers["content-type"] == "application/json" and sent.headers["host"] == f"127.0.0.1:{server.port}"
    assert owner.events[:2] == [("token", "He"), ("token", "llo")]
    kind, completion = owner.events[2]
    assert kind == "done" and completion.text == "Hello"
    assert (completion.prompt_tokens, completion.completion_tokens) == (3, 2)
    assert completion.finish_reason is FinishReason.LENGTH
    assert owner.relayed == [c.encode() for c in OK_CHUNKS[:3]]  # each event's bytes, as sent


def test_a_stream_in_one_read_is_flushed_once_and_a_sized_body_works_too() -> None:
    # The whole response in one write: the owner is flushed by the ending alone, not per token.
    owner, _, _ = asyncio.run(run(answer(sse_response(*OK_CHUNKS, chunked=False)), GenerateRequest("c1", "hi")))
    assert [k for k, _ in owner.events] == ["token", "token", "done"] and owner.flushes == 1


def test_an_api_key_file_is_sent_as_a_bearer_token(tmp_path: Any) -> None:
    key = tmp_path / "key"
    key.write_text("sk-test\n")

    async def scenario() -> ScriptedServer:
        server = await serve(answer(sse_response(*OK_CHUNKS)))
        endpoint = Endpoint("e", EndpointLimits(), time.monotonic())
        link = OpenAILink(OpenAITarget(server.base_url, "m", str(key), probe=False), endpoint)
        task = asyncio.create_task(link.maintain(HealthPolicy(0.05, 1.0, 5.0)))
        while not endpoint.up:
            await asyncio.sleep(0.01)
        await one_request(link, GenerateRequest("c1", "hi"))
        task.cancel()
        await server.close()
        return server

    server = asyncio.run(scenario())
    assert {r.headers["authorization"] for r in server.received} == {"Bearer sk-test"}


@pytest.mark.parametrize(
    ("status", "headers", "hint"),
    [("429 Too Many Requests", "retry-after-ms: 300\r\n", 300), ("503 Service Unavailable", "", 1000)],
)
def test_a_full_server_pauses_its_endpoint_and_the_request_is_busy(status: str, headers: str, hint: int) -> None:
    owner, link, _ = asyncio.run(
        run(answer(plain_response(status, b'{"error":"full"}', headers)), GenerateRequest("c1", "hi"))
    )
    assert owner.events == [("busy", hint)]
    assert link.endpoint.paused_until > time.monotonic() - 1 and link.busy_total == 1


def test_a_full_servers_pause_ends_on_the_clock_the_link_was_given() -> None:
    async def scenario() -> OpenAILink:
        server = await serve(answer(plain_response("429 Too Many Requests", b"{}", "retry-after-ms: 300\r\n")))
        link, task = await started_link(server.base_url, clock=FakeClock(1000.0))
        await one_request(link, GenerateRequest("c1", "hi"))
        task.cancel()
        await server.close()
        return link

    link = asyncio.run(scenario())
    assert link.endpoint.paused_until == pytest.approx(1000.3)


def test_a_refused_request_is_bad_frame_with_the_servers_words() -> None:
    owner, _, _ = asyncio.run(
        run(answer(plain_response("400 Bad Request", b"prompt too long")), GenerateRequest("c1", "hi"))
    )
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "bad_frame" and "prompt too long" in error.message


def test_a_long_error_body_is_quoted_up_to_its_preview() -> None:
    owner, _, _ = asyncio.run(
        run(answer(plain_response("500 Internal Server Error", b"x" * 100_000)), GenerateRequest("c1", "hi"))
    )
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "internal" and "x" * 512 in error.message
    assert "x" * 513 not in error.message


def test_a_connection_that_fails_is_a_lost_worker_and_the_endpoint_goes_down() -> None:
    async def scenario() -> tuple[Recorder, OpenAILink]:
        server = await serve(answer(b""))
        link, task = await started_link(server.base_url, HealthPolicy(60.0, 1.0, 5.0))
        await server.close()  # no server from now on: the next connection is refused
        for _ in range(100):
            if server._server is not None and not server._server.is_serving():
                break
            await asyncio.sleep(0.01)
        link._pool.close()  # type: ignore[union-attr]  # (its idle health connection)
        owner = await one_request(link, GenerateRequest("c1", "hi"))
        task.cancel()
        return owner, link

    owner, link = asyncio.run(scenario())
    ((kind, message),) = owner.events
    assert kind == "lost" and "ConnectFailed" in message
    assert link.last_error.startswith("ConnectFailed") and not link.endpoint.up


def test_a_malformed_stream_is_an_internal_error() -> None:
    owner, _, _ = asyncio.run(run(answer(sse_response('{"error": "boom"}')), GenerateRequest("c1", "x")))
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "internal" and "boom" in error.message
    json_body = plain_response("200 OK", b'{"choices": []}', "content-type: application/json\r\n")
    owner, _, _ = asyncio.run(run(answer(json_body), GenerateRequest("c1", "x")))
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "internal" and "text/event-stream" in error.message


@pytest.mark.parametrize(
    ("garbage", "why"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", "MalformedResponse"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000 + b"\r\n\r\n", "MalformedResponse"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100\r\n\r\ndata: {",
            "ConnectionBroken",
        ),
    ],
)
def test_a_hostile_server_is_a_lost_worker_and_nothing_else_breaks(garbage: bytes, why: str) -> None:
    owner, link, _ = asyncio.run(run(answer(garbage, keep=False), GenerateRequest("c1", "x")))
    ((kind, message),) = owner.events
    assert kind == "lost" and why in message and not link.inflight and not link._relays


def test_an_endless_event_is_refused_not_buffered() -> None:
    async def respond(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: ")
        for _ in range(40):  # 2.5 MiB of one line, until the link hangs up
            writer.write(b"a" * 65536)
            await writer.drain()
        return False

    owner, _, _ = asyncio.run(run(respond, GenerateRequest("c1", "x")))
    ((kind, error),) = owner.events
    assert kind == "error" and error.code == "internal" and "exceeds" in error.message


def test_a_silent_stream_times_out_as_that_requests_loss_only() -> None:
    async def scenario() -> tuple[Recorder, OpenAILink]:
        async def respond(request: Received, writer: asyncio.StreamWriter) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            await asyncio.sleep(5)
            return False

        server = await serve(respond)
        link, task = await started_link(server.base_url, HealthPolicy(0.05, 1.0, 0.3))
        owner = await one_request(link, GenerateRequest("c1", "x"))
        task.cancel()
        await server.close()
        return owner, link

    owner, link = asyncio.run(scenario())
    ((kind, message),) = owner.events
    assert kind == "lost" and "StallTimeout" in message and link.endpoint.up  # not the endpoint's loss


def test_a_cancel_closes_the_stream_and_answers_cancelled() -> None:
    async def endless(request: Received, writer: asyncio.StreamWriter) -> bool:
        writer.write(sse_response('{"choices":[{"text":"a"}]}')[:-5])  # no last chunk: still streaming
        for _ in range(500):  # an SSE comment every 10 ms, until the client hangs up
            await asyncio.sleep(0.01)
            writer.write(b"4\r\n: .\n\r\n")
            await writer.drain()
        return False

    async def scenario() -> tuple[Recorder, ScriptedServer]:
        server = await serve(endless)
        link, task = await started_link(server.base_url)
        owner = await one_request(link, GenerateRequest("c1", "x"), cancel_after_s=0.1)
        await asyncio.wait_for(server.disconnected.wait(), 5)
        task.cancel()
        await server.close()
        return owner, server

    owner, server = asyncio.run(scenario())
    assert owner.events[0] == ("token", "a")
    kind, completion = owner.events[-1]
    assert kind == "done" and completion.finish_reason is FinishReason.CANCELLED and completion.text == "a"
    assert server.disconnected.is_set()  # the stream was closed: the server sees the disconnect


def test_a_cancel_before_the_request_started_still_answers_cancelled() -> None:
    owner, link, _ = asyncio.run(run(answer(sse_response("[DONE]")), GenerateRequest("c1", "x"), 0))
    ((kind, completion),) = owner.events
    assert kind == "done" and completion.finish_reason is FinishReason.CANCELLED and completion.text == ""
    assert not link._relays  # nothing left behind


def test_a_stream_cut_before_its_end_is_a_lost_worker() -> None:
    owner, _, _ = asyncio.run(run(answer(sse_response('{"choices":[{"text":"a"}]}')), GenerateRequest("c1", "x")))
    assert owner.events[0] == ("token", "a")
    kind, message = owner.events[-1]
    assert kind == "lost" and "without [DONE]" in message


def test_connections_are_kept_alive_and_a_stale_one_is_replaced_once() -> None:
    """Three requests in turn: the first two share one connection; the server then closes that
    connection on the third without answering (its keep-alive timeout racing our write), and the
    request goes out again on a new connection."""
    served = 0

    async def respond(request: Received, writer: asyncio.StreamWriter) -> bool | None:
        nonlocal served
        served += 1
        if served == 3:
            return False  # closed without a byte
        writer.write(sse_response(*OK_CHUNKS))
        return None

    async def scenario() -> tuple[list[str], ScriptedServer]:
        server = await ScriptedServer(respond).start()
        endpoint = Endpoint("e", EndpointLimits(), time.monotonic())
        endpoint.up = True
        link = OpenAILink(OpenAITarget(server.base_url, "m", probe=False), endpoint)
        link._pool = link._open(HealthPolicy(60.0, 1.0, 5.0))  # no health checks: only the requests
        kinds = []
        for i in range(3):
            owner = await one_request(link, GenerateRequest(f"c{i}", "hi"), uid=f"u{i}")
            kinds.append(owner.events[-1][0])
        link._pool.close()
        await server.close()
        return kinds, server

    kinds, server = asyncio.run(scenario())
    assert kinds == ["done", "done", "done"]
    assert [r.connection for r in server.received] == [0, 0, 0, 1]  # the third sent twice


def test_through_a_door_the_lifecycle_ends_the_request_and_the_link_forgets_it() -> None:
    """The whole path: the NDJSON door, admission, the lifecycle and this link, to a server."""
    body = sse_response(
        '{"choices":[{"text":"Hi"}]}',
        '{"choices":[{"text":"","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}',
        "[DONE]",
    )

    async def scenario() -> tuple[list[dict[str, Any]], ServerState, OpenAILink]:
        server = await serve(answer(body))
        clock = FakeClock()
        endpoint = Endpoint("e", EndpointLimits(), clock())
        upstream = Upstream(
            [(OpenAITarget(server.base_url, "m", probe=False), endpoint)], HealthPolicy(0.05, 1.0, 5.0), clock=clock
        )
        link = upstream.links[0]
        assert isinstance(link, OpenAILink)
        state = make_state(upstream=upstream, endpoints=[endpoint], clock=clock, integrity=IntegrityMode.OFF)
        upstream.start()
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
        await upstream.close()
        await server.close()
        return [orjson.loads(line) for line in writes.lines()], state, link

    replies, state, link = asyncio.run(scenario())
    assert replies[0] == {"id": "c", "status": "token", "index": 0, "token_id": None, "text": "Hi"}
    assert (replies[1]["status"], replies[1]["text"], replies[1]["finish_reason"]) == ("done", "Hi", "eos")
    assert not link.inflight  # answered: the link holds it no more (settled, then forgotten)
    assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0
