"""GovernorProtocol, the asyncio adapter, driven with a fake transport."""

from __future__ import annotations

from typing import Any

from governor.protocol import GovernorProtocol
from governor.state import InflightRequest
from governor.validation import GenerateRequest
from governor.wire import encode, generate_frame
from tests.fakes import FakeTransport, FakeUpstream, make_state


def connect(upstream: FakeUpstream, max_inflight: int = 4) -> tuple[GovernorProtocol, FakeTransport, Any]:
    state = make_state(max_inflight=max_inflight, upstream=upstream)
    protocol = GovernorProtocol(state, max_frame_bytes=4096)
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport, state


class ExplodingUpstream(FakeUpstream):
    def dispatch(self, request: InflightRequest, generate: GenerateRequest) -> None:
        if generate.prompt == "boom":
            raise RuntimeError("a bug in dispatch")
        super().dispatch(request, generate)


def test_a_bug_costs_one_connection_with_an_internal_reply_and_balanced_counters() -> None:
    protocol, transport, state = connect(ExplodingUpstream())
    protocol.data_received(encode(generate_frame("ok", "fine")) + encode(generate_frame("bad", "boom")))
    assert transport.replies()[-1]["code"] == "internal"
    assert transport.closed
    protocol.connection_lost(None)
    assert state.limiter.inflight == 0
    assert state.accounting.failed["internal"] == 1
    assert state.accounting.unbalanced_by(0) == 0
    assert not state.connections


def test_eof_settles_in_flight_requests_at_once() -> None:
    upstream = FakeUpstream()
    protocol, transport, state = connect(upstream)
    protocol.data_received(encode(generate_frame("a", "x")))
    assert state.limiter.inflight == 1
    assert protocol.eof_received() is None  # our side closes too
    assert state.limiter.inflight == 0
    assert upstream.sent_frames == [{"id": "1", "op": "cancel"}]
    assert state.accounting.failed["client_disconnected"] == 1


def test_full_write_buffer_pauses_reading_until_it_drains() -> None:
    protocol, transport, _ = connect(FakeUpstream())
    protocol.pause_writing()
    assert not transport.reading
    protocol.resume_writing()
    assert transport.reading
    protocol.pause_writing()
    transport.close()
    protocol.resume_writing()  # closing: stays paused
    assert not transport.reading
