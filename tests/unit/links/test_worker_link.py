"""WorkerLink's handling of what the worker sends, with a fake transport, lifecycle and owner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.limits import Grant
from governor.lifecycle import InflightRequest, Phase
from governor.links.health import HealthPolicy
from governor.links.upstream import Upstream
from governor.links.worker_link import WorkerLink
from govwire.address import Address
from govwire.codec import encode, encode_token
from govwire.errors import GovernorError
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import ReservedId
from tests.fakes import FakeTransport, done_frame


class RecordingLifecycle:
    """What the link asks of the lifecycle, recorded: a request's start and how it ends."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, request: InflightRequest) -> None:
        request.phase = Phase.STARTED
        self.calls.append(("start", request.client_id))

    def token(self, request: InflightRequest) -> None:
        request.tokens_seen += 1
        if request.phase is not Phase.STARTED:
            self.start(request)

    def finish(self, request: InflightRequest, completion: Completion) -> None:
        self.calls.append(("finish", completion.text))

    def fail(self, request: InflightRequest, error: GovernorError) -> None:
        self.calls.append(("fail", error.code))

    def lose(self, request: InflightRequest, message: str) -> None:
        self.calls.append(("lose", request.client_id))


class Owner:
    def __init__(self) -> None:
        self.active: dict[str, InflightRequest] = {}
        self.tokens: list[bytes] = []
        self.flushes = 0

    def worker_token(self, request: InflightRequest, rest: bytes) -> None:
        self.tokens.append(rest)

    def flush(self) -> None:
        self.flushes += 1


def new_link(clock: Callable[[], float] = time.monotonic) -> WorkerLink:
    """A link as Upstream makes it: bound to a lifecycle (this one records)."""
    link = WorkerLink(Address(path="/tmp/x.sock"), Endpoint("x", EndpointLimits(), 0.0), clock=clock)
    link.lifecycle = RecordingLifecycle()  # type: ignore[assignment]
    return link


def linked(clock: Callable[[], float] = time.monotonic) -> tuple[WorkerLink, FakeTransport, Owner, RecordingLifecycle]:
    link = new_link(clock)
    lifecycle: RecordingLifecycle = link.lifecycle  # type: ignore[assignment]
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    link.data_received(b'{"id":"~ping","status":"pong"}\n')
    assert link.endpoint.up
    owner = Owner()
    request = InflightRequest("client-1", owner, Grant(), 0.0)
    request.uid, request.link, request.phase = "u1", link, Phase.DISPATCHED
    link.inflight["u1"] = request
    return link, transport, owner, lifecycle


DONE = encode(done_frame("u1", "hi", completion_tokens=1))


def test_frames_are_routed_by_uid_and_unknown_uids_skipped() -> None:
    link, transport, owner, lifecycle = linked()
    link.data_received(DONE + encode(done_frame("gone")))
    assert lifecycle.calls == [("finish", "hi")]
    assert owner.flushes == 1 and not transport.closed


def test_token_frames_are_routed_as_bytes_without_parsing() -> None:
    link, transport, owner, lifecycle = linked()
    token = encode_token("u1", 0, 104, 'h"\n')
    link.data_received(token + encode_token("gone", 1, 105, "i") + token + DONE)
    assert owner.tokens == [token[len(b'{"id":"u1"') : -1]] * 2  # everything after the id, no newline
    assert lifecycle.calls == [("start", "client-1"), ("finish", "hi")] and owner.flushes == 1
    assert link.inflight["u1"].tokens_seen == 2


def test_a_tokens_time_is_read_on_the_clock_the_link_was_given() -> None:
    link, _, _, _ = linked(lambda: 42.0)
    link.data_received(encode_token("u1", 0, 104, "h"))
    assert link.inflight["u1"].t_last_token == 42.0 and link.last_progress_at == 42.0


@pytest.mark.parametrize(
    ("reply", "ending"),
    [
        (b'{"id":"u1","status":"error","code":"bad_frame","message":"too long"}', ("fail", "bad_frame")),
        (b'{"id":"u1","status":"error","code":"no such code"}', ("fail", "internal")),
        (b'{"id":"u1","status":"done","text":""}', ("fail", "internal")),  # a malformed done
        (b'{"id":"u1","status":"sleeping"}', ("fail", "internal")),
    ],
)
def test_a_reply_is_read_once_into_one_ending(reply: bytes, ending: tuple[str, str]) -> None:
    link, transport, owner, lifecycle = linked()
    link.data_received(reply + b"\n")
    assert lifecycle.calls == [ending] and owner.flushes == 1 and not transport.closed


def test_a_token_frame_in_another_order_takes_the_parsed_path_to_the_same_bytes() -> None:
    link, _, owner, lifecycle = linked()
    link.data_received(b'{"status":"token","id":"u1","index":0,"token_id":104,"text":"h"}\n')
    assert owner.tokens == [encode_token("u1", 0, 104, "h")[len(b'{"id":"u1"') : -1]]
    assert lifecycle.calls == [("start", "client-1")]


@pytest.mark.parametrize(
    "garbage", [b"not json\n", b'{"status":"done"}\n', b'{"id":null,"status":"error"}\n', b"[1]\n"]
)
def test_an_unattributable_reply_breaks_the_link_so_nothing_hangs(garbage: bytes) -> None:
    link, transport, owner, lifecycle = linked()
    link.data_received(garbage + DONE)
    assert transport.closed and lifecycle.calls == []  # nothing after the garbage is trusted
    link.connection_lost(None)
    assert lifecycle.calls == [("lose", "client-1")]
    assert not link.is_connected and not link.endpoint.up


def test_an_endpoint_is_up_only_once_its_worker_answers_a_ping() -> None:
    link = new_link()
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    assert link.is_connected and not link.endpoint.up  # connected is not enough: it must answer
    assert link.probe(10.0, timeout_s=5.0)
    assert bytes(transport.written) == b'{"id":"~ping","op":"ping"}\n'
    assert link.probe(12.0, timeout_s=5.0) and transport.written.count(b"\n") == 1  # one pending at a time
    link.data_received(b'{"id":"%s","status":"pong"}\n' % ReservedId.PING.encode())
    assert link.endpoint.up and link.ping_pending_since is None


def test_a_ping_unanswered_past_the_timeout_fails_the_probe() -> None:
    link, transport, _, _ = linked()
    assert link.probe(100.0, timeout_s=5.0)
    assert link.probe(105.0, timeout_s=5.0)
    assert not link.probe(105.1, timeout_s=5.0)


def test_a_refusal_under_the_ping_id_is_not_an_answer() -> None:
    link = new_link()
    link.connection_made(FakeTransport())  # type: ignore[arg-type]
    link.data_received(b'{"id":"~ping","status":"error","code":"unauthorized","message":"no"}\n')
    assert not link.endpoint.up and link.is_connected  # the worker closes it; nothing is attributed


def test_a_link_stalls_when_its_requests_hear_nothing_for_the_timeout() -> None:
    clock = [100.0]
    link, _, owner, _ = linked(lambda: clock[0])  # holds u1, added by hand: the stall clock starts at submit()
    link.inflight.clear()
    link.submit("u1", InflightRequest("client-1", owner, Grant(), 0.0), GenerateRequest("client-1", "x"))
    clock[0] = 160.0
    assert not link.stalled(clock[0], timeout_s=60.0)
    link.data_received(b'{"id":"~stats","status":"stats"}\n{"id":"~ping","status":"pong"}\n')
    assert link.stalled(160.1, timeout_s=60.0)  # link traffic is not progress
    link.data_received(b'{"id":"u1","status":"token","index":0}\n')
    assert not link.stalled(219.0, timeout_s=60.0)
    clock[0] = 230.0
    link.data_received(b'{"id":"~stats","status":"stats","steps_total":7}\n')  # the engine steps others'
    assert not link.stalled(289.0, timeout_s=60.0) and link.stalled(290.1, timeout_s=60.0)
    link.inflight.clear()
    assert not link.stalled(1e9, timeout_s=60.0)  # nothing in flight: nothing to stall


def test_a_worker_that_closes_before_answering_is_retried_with_backoff_not_in_a_loop(tmp_path: Path) -> None:
    path = str(tmp_path / "w.sock")

    async def scenario() -> int:
        accepted = 0

        def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            writer.close()  # as a worker refusing our secret does

        server = await asyncio.start_unix_server(refuse, path)
        upstream = Upstream([(Address(path=path), Endpoint("w", EndpointLimits(), 0.0))], HealthPolicy(0.05, 1.0))
        upstream.start()
        await asyncio.sleep(1.0)
        await upstream.close()
        server.close()
        return accepted

    accepted = asyncio.run(scenario())
    assert 2 <= accepted <= 12  # backoff 20 ms doubling: about 6 in a second (a tight loop made >1000)


def test_the_workers_running_set_from_its_statistics_is_its_endpoints_batch() -> None:
    link, _, _, _ = linked()
    assert link.endpoint.batch == 0  # not known
    link.data_received(b'{"id":"~stats","status":"stats","max_batch_size":8,"max_running":12}\n')
    assert link.endpoint.batch == 12
    link.data_received(b'{"id":"~stats","status":"stats"}\n')  # a push without it keeps what is known
    assert link.endpoint.batch == 12
