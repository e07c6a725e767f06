"""The HTTP front door's core (doors/http.py), sans IO: request bytes in, response bytes out."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

import httptools
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.accounting import ShedReason
from governor.admission.cost import Ask
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.admission.tenant import TenantLimits
from governor.doors import gateway
from governor.doors.gateway_policy import GatewayPolicy
from governor.doors.http import HttpIngress
from governor.doors.http_wire import HttpLimits
from governor.state import ServerState
from govwire.auth import TenantSecrets
from govwire.codec import encode_token
from govwire.errors import BadFrame, WorkerUnavailable
from govwire.messages import Completion
from govwire.request import IntegrityMode
from govwire.vocab import FinishReason, Priority
from tests.fakes import FakeClock, FakeTimers, FakeTransportWrites, FakeUpstream, done_frame, make_state


@dataclass
class Parsed:
    status: int
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Responses:
    """Responses read back with httptools' response parser."""

    done: list[Parsed] = field(default_factory=list)
    _headers: dict[str, str] = field(default_factory=dict)
    _body: list[bytes] = field(default_factory=list)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append(Parsed(self.parser.get_status_code(), self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []

    @classmethod
    def of(cls, data: bytes) -> list[Parsed]:
        responses = cls()
        responses.parser = httptools.HttpResponseParser(responses)  # type: ignore[attr-defined]
        responses.parser.feed_data(data)  # type: ignore[attr-defined]
        return responses.done


def post(body: dict[str, Any] | bytes, *headers: str, close: bool = False) -> bytes:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    lines = ["POST /v1/completions HTTP/1.1", "host: x", f"content-length: {len(data)}", *headers]
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def completion(prompt: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "gpt2", "prompt": prompt, "max_tokens": 4, **fields}


class Client:
    def __init__(self, state: ServerState, limits: HttpLimits | None = None, trusted: bool = False) -> None:
        self.writes = FakeTransportWrites()
        self.closed: list[ShedReason | None] = []
        self.backlog: list[bool] = []
        self.core = HttpIngress(
            state,
            self.writes,
            limits or HttpLimits(),
            ["gpt2"],
            self.backlog.append,
            self.closed.append,
            trusted=trusted,
        )

    def send(self, data: bytes) -> list[Parsed]:
        self.core.receive_data(data)
        return self.responses()

    def responses(self) -> list[Parsed]:
        return Responses.of(b"".join(self.writes.chunks))


def balanced(state: ServerState) -> bool:
    return state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_a_yield_is_a_429_with_both_retry_headers_and_the_reason() -> None:
    state = make_state(
        max_inflight=1, integrity=IntegrityMode.OFF, hint_policy=RetryHintPolicy(jitter=0.0, horizon_ms=2000)
    )
    # admitted: its response comes with its completion. 15 tokens at the prior 0.1 s a token (a
    # first token a step after admission, 14 steps more): forecast to end 1.5 s after admission
    assert Client(state).send(post(completion(max_tokens=15, ignore_eos=True))) == []  # its length known
    (refused,) = Client(state).send(post(completion()))
    assert refused.status == 429
    # told to be back by 1 ms before that release (the lobby's "be here by": lateness 0 + 1 ms),
    # within the 2 s horizon: retryable, and Retry-After is its ceiling in whole seconds
    retry = [name for name in refused.headers if name in ("x-should-retry", "retry-after-ms", "retry-after")]
    assert retry == ["x-should-retry", "retry-after-ms", "retry-after"]
    assert refused.headers["x-should-retry"] == "true"
    assert refused.headers["retry-after-ms"] == "1499" and refused.headers["retry-after"] == "2"
    error = orjson.loads(refused.body)["error"]
    assert error["code"] == "inflight" and error["type"] == "rate_limit_error"
    # One body per reason (load generators count errors by it): the wait is only in the headers.
    assert error == {
        "message": "yielded: inflight",
        "type": "rate_limit_error",
        "param": None,
        "code": "inflight",
        "reason": "inflight",
    }
    assert state.accounting.yielded["inflight"] == 1 and state.accounting.final["inflight"] == 0 and balanced(state)
    hints = state.latency.retry_hints["inflight"]  # governor_retry_hint_seconds{reason="inflight"}
    assert hints.count == 1 and hints.total == 1.499


def test_a_final_refusal_is_a_429_that_says_not_to_retry_and_names_no_wait() -> None:
    state = make_state(max_inflight=1, integrity=IntegrityMode.OFF, hint_policy=RetryHintPolicy(jitter=0.0))
    # 16 tokens at the prior 0.1 s a token: forecast to end 1.6 s after admission, past the 1 s
    # promise horizon: the refusal is final
    assert Client(state).send(post(completion(max_tokens=16, ignore_eos=True))) == []  # its length known
    (refused,) = Client(state).send(post(completion()))
    assert refused.status == 429 and refused.headers["x-should-retry"] == "false"
    assert not {"retry-after-ms", "retry-after", "retry-ticket"} & set(refused.headers)
    assert orjson.loads(refused.body)["error"] == {
        "message": "overloaded: no capacity within the promise horizon (inflight); do not retry now",
        "type": "rate_limit_error",
        "param": None,
        "code": "overloaded",
        "reason": "inflight",
        "final": True,
    }
    assert state.accounting.yielded["inflight"] == 1 and state.accounting.final["inflight"] == 1 and balanced(state)
    assert not state.admission.appointments.by_ticket  # no promise booked for it
    hints = state.latency.retry_hints["inflight"]  # the forecast is still observed
    assert hints.count == 1 and hints.total == 1.6


def test_metrics_are_served_on_the_front_door_without_auth() -> None:
    state = make_state(auth=TenantSecrets.from_text("s3cret", "test"))
    writes = FakeTransportWrites()
    core = HttpIngress(state, writes, HttpLimits(), ["gpt2"], metrics=lambda: b"governor_up 1\n")
    core.receive_data(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\nPOST /metrics HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
    got, refused = Responses.of(b"".join(writes.chunks))
    assert got.status == 200 and got.body == b"governor_up 1\n" and got.headers["content-type"].startswith("text/plain")
    assert refused.status == 405
    # aiperf checks it with a HEAD first: the head of the GET's answer, no body, and the
    # connection goes on.
    head_writes = FakeTransportWrites()
    head = HttpIngress(state, head_writes, HttpLimits(), ["gpt2"], metrics=lambda: b"governor_up 1\n")
    head.receive_data(b"HEAD /metrics HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    first, _, rest = b"".join(head_writes.chunks).partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"content-length: 14" in first.lower()
    (then,) = Responses.of(rest)  # right after the head: the next response, not the metrics' bytes
    assert then.status in (200, 503) and then.body.startswith(b'{"status"')
    no_metrics = Client(make_state()).send(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    assert [r.status for r in no_metrics] == [404]  # a door built without an exposition has no such route


def test_pipelined_requests_are_answered_in_order() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state)
    assert client.send(post(completion("a")) + post(completion("b"))) == []  # b waits for a's response
    (uid_a,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid_a, "A", completion_tokens=1))
    first = client.responses()
    assert [r.status for r in first] == [200] and orjson.loads(first[0].body)["choices"][0]["text"] == "A"
    # b is decided on the loop's next turn, not inside the worker's read that ended a
    assert [u for u in upstream.dispatched if u != uid_a] == []
    assert isinstance(state.timers, FakeTimers) and state.timers.fire_due() == 1
    uid_b = [u for u in upstream.dispatched if u != uid_a][0]  # b was dispatched once a was answered
    _, generate_b = upstream.dispatched[uid_b]
    assert generate_b.prompt == "b"
    upstream.worker_sends(done_frame(uid_b, "B", completion_tokens=1))
    assert [orjson.loads(r.body)["choices"][0]["text"] for r in client.responses()] == ["A", "B"]
    assert state.accounting.executed == 2 and balanced(state)


def test_response_ids_never_repeat_across_connections_and_chat_ids_are_chatcmpl() -> None:
    # Each request on a connection of its own, the last one freed first: an id built from the
    # connection object's address repeated once the address was reused (240 unique of 300).
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, integrity=IntegrityMode.OFF, upstream=upstream)
    ids: list[str] = []
    for i in range(300):
        chat = i % 2 == 1
        client = Client(state)
        if chat:
            body = orjson.dumps({"model": "gpt2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            client.send(post(body).replace(b"/v1/completions", b"/v1/chat/completions"))
        else:
            client.send(post(completion()))
        (uid,) = upstream.link.inflight  # the one in flight
        upstream.worker_sends(done_frame(uid, "x", completion_tokens=1))
        (answered,) = client.responses()
        rid = orjson.loads(answered.body)["id"]
        assert rid.startswith("chatcmpl-" if chat else "cmpl-")
        ids.append(rid)
        del client
    assert len(set(ids)) == len(ids) == 300
    assert state.accounting.executed == 300 and balanced(state)


def test_a_stream_sends_its_head_with_the_first_token_then_events_and_done() -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state)
    client.send(post(completion(stream=True, stream_options={"include_usage": True})))
    assert client.writes.chunks == []  # no status before the first token
    (uid,) = upstream.dispatched
    upstream.worker_sends(encode_token(uid, 0, 7, "Hi"), done_frame(uid, "Hi", "length", completion_tokens=1))
    (streamed,) = client.responses()
    assert streamed.status == 200 and streamed.headers["content-type"] == "text/event-stream"
    events = [e for e in streamed.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Hi"
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("wants_usage", [False, True])
def test_an_openai_endpoints_events_are_relayed_as_they_came(wants_usage: bool) -> None:
    """What an OpenAI-compatible link hands over goes out byte for byte: no re-encoding, a usage
    chunk only to a client that asked, its finish chunk instead of ours, then [DONE]."""
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state)
    options = {"stream_options": {"include_usage": True}} if wants_usage else {}
    client.send(post(completion(stream=True, **options)))
    (uid,) = upstream.dispatched
    request = client.core.active[next(iter(client.core.active))]
    theirs = [
        b'{"id":"up-1","choices":[{"text":"Hi"}]}',
        b'{"id":"up-1","choices":[{"text":"","finish_reason":"stop"}]}',
    ]
    usage = b'{"id":"up-1","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    state.lifecycle.token(request)
    client.core.relay_event(request, "Hi", theirs[0], False, False)
    client.core.relay_event(request, "", theirs[1], False, False)
    client.core.relay_event(request, "", usage, True, True)
    state.lifecycle.finish(request, Completion("Hi", 1, 1, FinishReason.EOS, 0.0))
    client.core.flush()
    (streamed,) = client.responses()
    events = [e for e in streamed.body.split(b"\n\n") if e]
    expected = [b"data: " + e for e in theirs] + ([b"data: " + usage] if wants_usage else []) + [b"data: [DONE]"]
    assert events == expected and balanced(state)


def test_a_busy_endpoint_before_the_first_token_is_a_late_429_and_balances() -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state)
    client.send(post(completion(stream=True)))
    ((uid, (request, _)),) = upstream.dispatched.items()
    state.admission.pool.endpoints[0].paused_until = state.clock() + 0.25  # nowhere to re-route
    state.lifecycle.busy(request, 250)
    request.owner.flush()
    (late,) = client.responses()
    assert late.status == 429 and late.headers["retry-after-ms"] == "250"
    assert orjson.loads(late.body)["error"]["code"] == "endpoint_busy"
    assert state.accounting.yielded["endpoint_busy"] == 1 and balanced(state)
    (refused,) = Client(state).send(post(completion()))  # and the pool routes around the pause
    assert refused.status == 429 and orjson.loads(refused.body)["error"]["code"] == "endpoint_busy"


def test_content_digest_is_verified_and_required_under_http_integrity_required() -> None:
    state = make_state(max_inflight=8, integrity=IntegrityMode.OFF)  # the NDJSON port's: not the door's
    required = HttpLimits(integrity=IntegrityMode.REQUIRED)
    body = orjson.dumps(completion())
    good = "content-digest: sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
    assert Client(state, required).send(post(body, good)) == []  # admitted
    (missing,) = Client(state, required).send(post(body))
    assert missing.status == 400 and b"Content-Digest" in missing.body and b"--http-integrity" in missing.body
    wrong = "content-digest: sha-256=:" + base64.b64encode(b"x" * 32).decode() + ":"
    (mismatch,) = Client(state, required).send(post(body, wrong))
    assert mismatch.status == 400 and orjson.loads(mismatch.body)["error"]["code"] == "integrity"
    assert state.admission.inflight.inflight == 1 and balanced(state)  # the failures were refunded


def test_the_door_verifies_a_digest_when_present_by_default_whatever_the_ndjson_port_requires() -> None:
    state = make_state(max_inflight=8, integrity=IntegrityMode.REQUIRED)
    body = orjson.dumps(completion())
    assert Client(state).send(post(body)) == []  # no Content-Digest (as the OpenAI SDKs send): admitted
    wrong = "content-digest: sha-256=:" + base64.b64encode(b"y" * 32).decode() + ":"
    (mismatch,) = Client(state).send(post(body, wrong))
    assert mismatch.status == 400 and orjson.loads(mismatch.body)["error"]["code"] == "integrity"
    assert state.admission.inflight.inflight == 1 and balanced(state)


def test_too_many_pipelined_requests_stop_the_reading() -> None:
    state = make_state(max_inflight=8, integrity=IntegrityMode.OFF)
    client = Client(state, HttpLimits(max_pipelined=2))
    client.send(b"".join(post(completion(str(i))) for i in range(4)))  # one admitted, three wait
    assert client.backlog == [True]


def test_a_slow_request_times_out_with_408() -> None:
    state = make_state(integrity=IntegrityMode.OFF)
    client = Client(state, HttpLimits(request_timeout_s=1.0))
    client.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    assert client.core.timeout(state.clock() + 0.5, 0) is None
    reason, error = client.core.timeout(state.clock() + 1.5, 0)  # type: ignore[misc]
    assert reason is ShedReason.SLOW_REQUEST and error is not None
    (answer,) = Responses.of(client.core.last_words(error))
    assert answer.status == 408


PIECES = st.sampled_from([post(completion()), b"\r\n", b"GET / HTTP/1.1\r\n\r\n"])


@settings(max_examples=300)
@given(
    st.lists(
        st.one_of(st.binary(max_size=64), st.sampled_from([post(completion()), b"\r\n", b"GET / HTTP/1.1\r\n\r\n"]))
    )
)
def test_any_bytes_get_responses_or_a_close_and_every_request_is_accounted(chunks: list[bytes]) -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=1, integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state, HttpLimits(max_body_bytes=512))
    for data in chunks:
        client.send(data)
        assert state.admission.inflight.inflight <= 1
        assert balanced(state)
    for parsed in client.responses():  # whatever came back parses as HTTP responses
        assert parsed.status in (200, 400, 404, 405, 413, 429, 431, 503)


# Bodies a client may get wrong once admitted (each answered 400), and the worker's endings.
CLIENT_MISTAKES = [
    completion(max_tokens=-1),
    completion(max_tokens=0),
    completion(n=3),
    completion(stop=["x"]),
    {"prompt": "no model", "max_tokens": 4},
    completion(prompt=["a", "b"]),
]


@settings(max_examples=200)
@given(st.lists(st.sampled_from([*CLIENT_MISTAKES, "done", "internal", "lost"]), max_size=12))
def test_only_the_endpoints_own_failures_count_against_it_and_the_counters_balance(steps: list[Any]) -> None:
    """A client's 4xx is rejected (the accounting says so), never an endpoint's failure; a
    worker's `internal` error and a lost link are. received = executed + yielded + rejected +
    failed + inflight throughout."""
    upstream = FakeUpstream()
    state = make_state(max_inflight=2, integrity=IntegrityMode.OFF, upstream=upstream)
    (endpoint,) = state.admission.pool.endpoints
    expected_failed = expected_executed = mistakes = 0
    for step in steps:
        client = Client(state)
        if isinstance(step, dict):
            (answer,) = client.send(post(step))
            assert answer.status == 400 and orjson.loads(answer.body)["error"]["code"] == "bad_frame"
            mistakes += 1
        else:
            assert client.send(post(completion())) == []
            (uid,) = upstream.link.inflight
            if step == "done":
                upstream.worker_sends(done_frame(uid, "x", completion_tokens=1))
                expected_executed += 1
            elif step == "internal":
                upstream.worker_sends({"id": uid, "status": "error", "code": "internal", "message": "boom"})
                expected_failed += 1
            else:  # its link dropped, and nowhere else to run it
                endpoint.up = False
                state.lifecycle.lose(upstream.link.inflight[uid], "gone")
                client.core.flush()  # as the link does after a loss
                endpoint.up = True
                expected_failed += 1
            assert len(client.responses()) == 1
        assert balanced(state) and state.admission.inflight.inflight == 0
    assert (endpoint.executed, endpoint.failed) == (expected_executed, expected_failed)
    assert state.accounting.rejected_total == mistakes


GATEWAY_NAMES = sorted(name.decode() for name in gateway.HEADERS_IN)


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(GATEWAY_NAMES),
            st.one_of(
                st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=70),
                st.sampled_from(["0", "1", "-1", "2s", "1500ms", "-1s", "1e309", "nan", "inf", "9" * 40, "chat"]),
            ),
        ),
        max_size=6,
    ),
    st.booleans(),
    st.sampled_from([None, "critical", "sheddable", 7]),
)
def test_any_gateway_headers_get_an_answer_and_leave_the_counters_balanced(
    headers: list[tuple[str, str]], trusted: bool, priority: object
) -> None:
    """Malformed, oversized, repeated or contradicting: a 400 naming the header, or an answer,
    never a crash or a leaked slot (repeated names are sent as repeated header lines)."""
    upstream = FakeUpstream()
    state = make_state(max_inflight=1, integrity=IntegrityMode.OFF, upstream=upstream, tenants={"a": TenantLimits()})
    limits = HttpLimits(gateway=GatewayPolicy(objectives={"chat": Priority.CRITICAL}))
    client = Client(state, limits, trusted=trusted)
    body = completion() if priority is None else completion(priority=priority)
    answers = client.send(post(body, *(f"{name}: {value}" for name, value in headers)))
    if not answers:  # admitted: its response comes with its completion
        assert state.admission.inflight.inflight == 1
    else:
        (answer,) = answers
        error = orjson.loads(answer.body)["error"]
        assert answer.status == 400 and error["code"] == "bad_frame", answer
        assert "x-" in error["message"] or "priority" in error["message"], error  # it names what is wrong
        assert state.admission.inflight.inflight == 0
    assert balanced(state)

    client.core.connection_lost()
    assert state.admission.inflight.inflight == 0 and balanced(state)


def test_a_request_rerouted_to_an_endpoint_that_cannot_take_it_still_gets_its_answer() -> None:
    class RefusingSecond(FakeUpstream):
        def dispatch(self, request: Any, generate: Any) -> None:
            if self.dispatched:
                raise BadFrame("this endpoint cannot take the request", request.client_id)
            super().dispatch(request, generate)

    clock = FakeClock()
    endpoints = [Endpoint(name, EndpointLimits(), clock()) for name in ("a", "b")]
    for e in endpoints:
        e.up = True
    upstream = RefusingSecond()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream, endpoints=endpoints, clock=clock)
    client = Client(state)
    client.send(post(completion()))
    ((_, (request, _)),) = upstream.dispatched.items()
    request.grant.endpoint.up = False  # its endpoint is lost: the re-route goes to the other one
    state.lifecycle.lose(request, "connection lost")
    request.owner.flush()
    (answer,) = client.responses()
    assert answer.status == 502 and orjson.loads(answer.body)["error"]["code"] == "worker_lost"
    assert state.admission.inflight.inflight == 0 and all(e.inflight == 0 for e in endpoints) and balanced(state)


def test_a_header_that_never_ends_is_431_without_waiting_for_it() -> None:
    client = Client(make_state(integrity=IntegrityMode.OFF), HttpLimits(max_header_bytes=1024))
    client.send(b"POST /v1/completions HTTP/1.1\r\nx-pad: ")
    for _ in range(10):
        client.send(b"x" * 500)
    (answer,) = client.responses()
    assert answer.status == 431 and client.core.closing is ShedReason.BAD_REQUEST


def test_odd_field_types_are_400_and_counted_once_through_the_front_door() -> None:
    state = make_state(integrity=IntegrityMode.OFF)
    client = Client(state)
    (answer,) = client.send(post(completion(priority=[1])))
    assert answer.status == 400 and orjson.loads(answer.body)["error"]["code"] == "bad_frame"
    assert state.accounting.received == state.accounting.http_received == 1 and balanced(state)


def test_an_upgrade_is_one_400_and_one_count() -> None:
    state = make_state(integrity=IntegrityMode.OFF)
    client = Client(state)
    body = orjson.dumps(completion())
    (answer,) = client.send(post(body, "connection: upgrade", "upgrade: h2c"))
    assert answer.status == 400 and b"upgrade" in answer.body
    assert state.accounting.received == state.accounting.http_received == 1


def test_nothing_is_read_after_a_connection_close_request() -> None:
    state = make_state(max_inflight=1, integrity=IntegrityMode.OFF)
    Client(state).send(post(completion()))  # hold the slot: the next request is answered at once
    client = Client(state)
    (answer,) = client.send(post(completion(), close=True) + b"GARBAGE AFTER\r\n\r\n")
    assert answer.status == 429 and answer.headers["connection"] == "close"
    assert client.closed == [None] and client.core.closing is None  # closed gracefully, not shed
    assert state.accounting.http_received == 2 and balanced(state)


def test_a_blank_line_between_requests_starts_no_timer() -> None:
    state = make_state(integrity=IntegrityMode.OFF)
    client = Client(state, HttpLimits(request_timeout_s=1.0))
    client.send(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    client.send(b"\r\n")
    assert client.core.timeout(state.clock() + 5.0, 0) is None


def test_an_http_1_0_stream_is_not_chunked_and_ends_with_the_connection() -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state)
    data = orjson.dumps(completion(stream=True))
    client.send(b"POST /v1/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
    (uid,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid, "", "eos", completion_tokens=0))
    written = b"".join(client.writes.chunks)
    assert b"transfer-encoding" not in written and written.rstrip().endswith(b"data: [DONE]")
    assert client.closed == [None]


def test_a_large_read_of_pipelined_requests_is_not_mistaken_for_long_headers() -> None:
    state = make_state(max_inflight=1, integrity=IntegrityMode.OFF)
    Client(state).send(post(completion()))  # hold the slot: every request below is answered at once
    client = Client(state, HttpLimits(max_header_bytes=1024))
    data = b"".join(post(completion()) for _ in range(3000))
    for at in range(0, len(data), 65536):
        client.send(data[at : at + 65536])
    statuses = [r.status for r in client.responses()]
    assert statuses == [429] * 3000 and client.core.closing is None


def test_a_429_carries_the_appointments_ticket_and_the_retry_is_let_in_by_it_or_by_its_body() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    # (a 2 s horizon: the junk client's slot is the round after mine, 0.5 + 0.5 s less 1 ms = 999 ms,
    # which the default 1 s horizon keeps bookable by only a millisecond)
    state = make_state(
        max_inflight=1, integrity=IntegrityMode.OFF, hint_policy=RetryHintPolicy(jitter=0.0, horizon_ms=2000),
        clock=clock, upstream=upstream,
    )  # fmt: skip
    # holds the slot, forecast to end at 0.5 s: 5 tokens at the prior 0.1 s a token
    assert Client(state).send(post(completion("hold", max_tokens=5, ignore_eos=True))) == []
    refused_by_body = Client(state).send(post(completion("mine")))[0]
    # told to be back by 1 ms before the release (the lobby's "be here by": lateness 0 + 1 ms)
    assert refused_by_body.status == 429 and refused_by_body.headers["retry-after-ms"] == "499"
    assert refused_by_body.headers["x-should-retry"] == "true"
    ticket = refused_by_body.headers["retry-ticket"]
    (junk,) = Client(state).send(post(completion("other"), "retry-ticket: \xff" + "x" * 300))  # no ticket
    assert junk.status == 429 and junk.headers["retry-ticket"] != ticket
    clock.advance(0.5)
    (uid,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid, "done", completion_tokens=4))  # the slot frees on time
    # in the window the slot is kept: a fresh request is refused, the one re-sending its body is in
    assert Client(state).send(post(completion("fresh")))[0].status == 429
    assert Client(state).send(post(completion("mine"))) == []
    assert state.admission.appointments.outcomes[("inflight", "on_time")] == 1
    assert balanced(state)


# -- the gateway contract (doors/gateway.py): headers in, headers out ----------------------------------


def test_every_refusal_says_why_in_llm_ds_words_beside_the_governors_reason() -> None:
    state = make_state(max_inflight=1, integrity=IntegrityMode.OFF, hint_policy=RetryHintPolicy(jitter=0.0))
    assert Client(state).send(post(completion(max_tokens=4))) == []  # admitted; ends within the horizon
    (yielded,) = Client(state).send(post(completion()))
    assert yielded.status == 429 and yielded.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert orjson.loads(yielded.body)["error"]["code"] == "inflight"  # the governor's own reason stays
    final_state = make_state(max_inflight=1, integrity=IntegrityMode.OFF, hint_policy=RetryHintPolicy(jitter=0.0))
    assert Client(final_state).send(post(completion(max_tokens=16, ignore_eos=True))) == []  # past the 1 s horizon
    (final,) = Client(final_state).send(post(completion()))
    assert final.headers["x-should-retry"] == "false"
    assert final.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    state.admission.start_draining()
    (draining,) = Client(state).send(post(completion()))
    assert draining.status == 503 and draining.headers["x-llm-d-request-dropped-reason"] == "rejected-shutting-down"
    assert balanced(state) and balanced(final_state)
    # No endpoint up: the upstream fails the admitted request before any of its response.
    down = make_state(integrity=IntegrityMode.OFF, upstream=FakeUpstream())
    client = Client(down)
    client.send(post(completion()))
    client.core.send_error(next(iter(client.core.active.values())), WorkerUnavailable("no endpoint is up"))
    client.core.flush()
    (unavailable,) = client.responses()
    assert (
        unavailable.status == 503 and unavailable.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    )


def test_an_admitted_response_carries_its_queue_time_and_the_headroom_left() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, integrity=IntegrityMode.OFF, upstream=upstream)
    client, stream = Client(state), Client(state)
    client.send(post(completion("a")))
    stream.send(post(completion("b", stream=True)))
    uid_a, uid_b = list(upstream.dispatched)
    upstream.worker_sends(done_frame(uid_a, "A", completion_tokens=1))
    (plain,) = client.responses()
    # admitted first, with 3 of the 4 slots left after it
    assert plain.headers["x-llm-d-flow-queue-duration-ms"] == "0"
    assert plain.headers["x-llm-d-flow-band-headroom-requests"] == "3"
    upstream.worker_sends(encode_token(uid_b, 0, 7, "B"), done_frame(uid_b, "B", completion_tokens=1))
    (streamed,) = stream.responses()
    assert streamed.headers["x-llm-d-flow-band-headroom-requests"] == "2"  # a was still in flight
    assert balanced(state)


def test_the_headroom_is_that_of_the_limit_that_binds_first() -> None:
    endpoint = Endpoint("fake", EndpointLimits(concurrency=8), 0.0)
    endpoint.up = True
    state = make_state(max_inflight=8, integrity=IntegrityMode.OFF, endpoints=[endpoint], max_inflight_tokens=100)
    grant = state.admission.decide(0.0, state.costs.ask({"prompt": "x" * 40, "max_new_tokens": 20}))
    assert not isinstance(grant, Refusal)
    # 30 tokens held of 100: 70 free, two more of this cost; 7 slots free
    assert state.admission.headroom(grant, 0.0) == 2


def test_the_headroom_counts_under_the_requests_class_ceiling() -> None:
    state = make_state(max_inflight=10, integrity=IntegrityMode.OFF)
    admission = state.admission
    for _ in range(6):
        assert not isinstance(admission.decide(0.0, Ask()), Refusal)
    admission.ceilings.ceiling(Priority.CRITICAL, 0.0)  # a critical frame came ...
    admission.ceilings.refused(Priority.CRITICAL, 0.0, 0.0)  # ... and was refused: the gates below close
    sheddable = admission.decide(0.0, Ask(priority=Priority.SHEDDABLE))
    assert isinstance(sheddable, Grant) and sheddable.ask.ceiling == 0.8
    # 7 of 10 in flight, but a sheddable request may fill 8: one more, not three
    assert admission.headroom(sheddable, 0.0) == 1
    assert isinstance(admission.decide(0.0, Ask(priority=Priority.SHEDDABLE)), Grant)
    assert isinstance(admission.decide(0.0, Ask(priority=Priority.SHEDDABLE)), Refusal)


def test_a_blind_retry_shed_by_its_own_cap_closes_no_gate_for_first_attempts() -> None:
    state = make_state(max_inflight=10, integrity=IntegrityMode.OFF)
    admission = state.admission
    admission.shed_blind_retries = True
    grants = [admission.decide(0.0, Ask()) for _ in range(10)]
    assert isinstance(admission.decide(0.0, Ask()), Refusal)  # a first attempt refused: blind retries are capped
    admission.release(grants[0], True, 0.0)  # 9 of 10
    blind = Ask(priority=Priority.CRITICAL)
    blind.retry = True
    assert isinstance(admission.decide(0.0, blind), Refusal)  # held to 8 of 10, critical or not
    # ... which is no shortage of critical capacity: a standard first attempt still gets the last slot
    assert admission.ceilings.current(0.0)["standard"] == 1.0
    assert isinstance(admission.decide(0.0, Ask()), Grant)


def test_a_trusted_gateways_headers_set_tenant_class_and_deadline() -> None:
    upstream = FakeUpstream()
    state = make_state(
        max_inflight=4, integrity=IntegrityMode.OFF, upstream=upstream, tenants={"team-a": TenantLimits()}
    )
    limits = HttpLimits(gateway=GatewayPolicy(objectives={"chat": Priority.CRITICAL}))
    gateway_headers = (
        "x-llm-d-inference-fairness-id: team-a",
        "x-llm-d-inference-objective: chat",
        "x-llm-d-inference-ttl: 2s",
        "x-llm-d-slo-ttft-ms: 1500",
    )
    assert Client(state, limits, trusted=True).send(post(completion(), *gateway_headers)) == []
    assert Client(state, limits, trusted=False).send(post(completion(), *gateway_headers)) == []
    (trusted, _), (untrusted, _) = upstream.dispatched.values()
    assert trusted.grant.ask.tenant.name == "team-a" and untrusted.grant.ask.tenant.name == "default"
    assert trusted.grant.ask.priority is Priority.CRITICAL and trusted.grant.ask.deadline_s == 1.5
    assert state.accounting.classes[Priority.CRITICAL].admitted == 2  # the class is not a matter of trust


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ("x-llm-d-inference-ttl: -1s", "x-llm-d-inference-ttl"),
        ("x-dynamo-request-priority: -1", "priority"),  # sheddable, against the body's critical
        ("x-dynamo-request-priority: soon", "x-dynamo-request-priority"),
        ("x-llm-d-inference-fairness-id: a\r\nx-llm-d-inference-fairness-id: b", "x-llm-d-inference-fairness-id"),
        ("x-stainless-retry-count: -2", "x-stainless-retry-count"),
    ],
)
def test_a_bad_gateway_header_is_a_400_naming_it_and_nothing_leaks(header: str, named: str) -> None:
    state = make_state(max_inflight=2, integrity=IntegrityMode.OFF)
    (answer,) = Client(state, trusted=True).send(post(completion(priority="critical"), *header.split("\r\n")))
    error = orjson.loads(answer.body)["error"]
    assert answer.status == 400 and error["code"] == "bad_frame" and named in error["message"]
    assert state.admission.inflight.inflight == 0 and balanced(state)


def test_retries_are_told_from_first_attempts_and_blind_ones_shed_first() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=5, integrity=IntegrityMode.OFF, upstream=upstream)
    state.admission.shed_blind_retries = True
    first = ("x-stainless-retry-count: 0",)
    retry = ("x-stainless-retry-count: 1",)
    for n in range(5):  # the first a blind retry: no first attempt was refused, so it may fill every cap
        assert Client(state).send(post(completion(str(n)), *(retry if n == 0 else first))) == []
    assert state.accounting.attempts == {"first": {"admitted": 4, "yielded": 0}, "retry": {"admitted": 1, "yielded": 0}}
    assert state.accounting.blind_retries == {"admitted": 1, "yielded": 0}
    (refused,) = Client(state).send(post(completion("5"), *first))  # full: a first attempt is refused
    assert refused.status == 429
    uid = next(iter(upstream.dispatched))
    upstream.worker_sends(done_frame(uid, "x", completion_tokens=1))  # one slot frees: 4 of 5 in flight
    # Now a blind retry may fill only the sheddable ceiling (0.8 of 5: 4): refused; a first attempt is not.
    (blind,) = Client(state).send(post(completion("6"), *retry))
    assert blind.status == 429 and orjson.loads(blind.body)["error"]["code"] == "inflight"
    assert Client(state).send(post(completion("7"), *first)) == []
    assert state.accounting.attempts == {"first": {"admitted": 5, "yielded": 1}, "retry": {"admitted": 1, "yielded": 1}}
    assert state.accounting.blind_retries == {"admitted": 1, "yielded": 1}
    assert balanced(state)
    # Without --shed-blind-retries a retry is only counted apart.
    upstream.worker_sends(done_frame(list(upstream.dispatched)[1], "x", completion_tokens=1))
    state.admission.shed_blind_retries = False
    assert Client(state).send(post(completion("8"), *retry)) == []


@pytest.mark.parametrize(
    ("body", "param", "starts"),
    [
        ({"prompt": "hi", "max_tokens": 4}, "model", "model is required"),
        (completion(model=None), "model", "model is required"),
        (completion(model=["gpt2"]), "model", "model '[\"gpt2\"]' is not served here"),
        (completion(model=["x" + "é" * 80]), "model", "model '[\"xéé"),  # cut at 100 characters, not bytes
        (completion(model="gpt3"), "model", "model 'gpt3' is not served here"),
        (completion(max_tokens=-5), "max_tokens", "max_tokens must be an integer in [1, "),
        (completion(max_tokens=0), "max_tokens", "max_tokens must be an integer"),
        (completion(max_tokens="5"), "max_tokens", "max_tokens must be an integer"),
        (completion(max_tokens=5000), "max_tokens", "max_tokens must be an integer"),
        (completion(max_tokens=1e30), "max_tokens", "max_tokens must be an integer"),
        (completion(n=3), "n", "n=3 is not supported"),
        (completion(tools=[]), "tools", "unsupported field 'tools'"),
        (completion(temperature=-1), "temperature", "temperature must be"),
        (completion(ignore_eos="yes"), "ignore_eos", "ignore_eos must be a boolean"),
        (completion(prompt=["a", "b"]), "prompt", "prompt must be a string"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field_in_the_clients_words(
    body: dict[str, Any], param: str, starts: str
) -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    (answer,) = Client(state).send(post(body))
    error = orjson.loads(answer.body)["error"]
    assert answer.status == 400 and error["type"] == "invalid_request_error" and error["code"] == "bad_frame"
    assert error["param"] == param and error["message"].startswith(starts), error
    assert "None" not in error["message"] and "max_new_tokens" not in error["message"]
    assert state.accounting.rejected_total == 1 and balanced(state)
    assert sum(e.failed for e in state.admission.pool.endpoints) == 0


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, None),
        ("application/json", None),
        ("Application/JSON; charset=utf-8", None),
        ("application/vnd.api+json", None),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
    ],
)
def test_a_body_that_says_it_is_not_json_is_415(content_type: str | None, status: int | None) -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    headers = [] if content_type is None else [f"content-type: {content_type}"]
    answers = Client(state).send(post(completion(), *headers))
    if status is None:
        assert answers == [] and len(upstream.dispatched) == 1  # admitted
    else:
        (answer,) = answers
        error = orjson.loads(answer.body)["error"]
        assert (
            answer.status == 415 and error["type"] == "invalid_request_error" and "application/json" in error["message"]
        )
        assert state.accounting.rejected_total == 1 and not upstream.dispatched
    assert balanced(state)


def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    client = Client(state)
    request = post(completion(), "expect: 100-continue")
    head, _, body = request.partition(b"\r\n\r\n")
    client.core.receive_data(head + b"\r\n\r\n")
    assert b"".join(client.writes.chunks) == b"HTTP/1.1 100 Continue\r\n\r\n"  # curl sends the body on this
    client.core.receive_data(body)
    assert len(upstream.dispatched) == 1
    # While a response is being written, no interim one cuts into it: the client waits it out.
    pipelined = post(completion(), "expect: 100-continue").partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
    client.core.receive_data(pipelined)
    assert b"".join(client.writes.chunks).count(b"100 Continue") == 1


def test_headers_too_large_are_a_client_error() -> None:
    client = Client(make_state(integrity=IntegrityMode.OFF), HttpLimits(max_header_bytes=1024))
    (answer,) = client.send(post(completion(), "x-big: " + "a" * 2000))
    assert answer.status == 431 and orjson.loads(answer.body)["error"]["type"] == "invalid_request_error"


def chat(**fields: Any) -> bytes:
    body = {"model": "gpt2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return post(orjson.dumps(body)).replace(b"/v1/completions", b"/v1/chat/completions")


@pytest.mark.parametrize(
    "neutral",
    [{"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}}, {"parallel_tool_calls": True}],
)
def test_chat_fields_sdk_wrappers_send_at_their_defaults_are_accepted(neutral: dict[str, Any]) -> None:
    upstream = FakeUpstream()
    state = make_state(integrity=IntegrityMode.OFF, upstream=upstream)
    assert Client(state).send(chat(**neutral)) == [] and len(upstream.dispatched) == 1


@pytest.mark.parametrize(
    ("asking", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_chat_fields_that_ask_for_more_are_refused_naming_them(asking: dict[str, Any], param: str) -> None:
    state = make_state(integrity=IntegrityMode.OFF, upstream=FakeUpstream())
    (answer,) = Client(state).send(chat(**asking))
    assert answer.status == 400 and orjson.loads(answer.body)["error"]["param"] == param
