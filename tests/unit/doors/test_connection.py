"""GovernorProtocol, the asyncio adapter, driven with a fake transport."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import ANY

from governor.doors.connection import ConnectionLimits, GovernorProtocol
from governor.doors.ndjson import DEFER_AFTER_REFUSED
from governor.doors.turns import FRAMES_PER_TURN, TurnQueue
from governor.lifecycle import InflightRequest
from governor.state import ServerState
from govwire.auth import TenantSecrets
from govwire.codec import encode, generate_frame
from govwire.request import GenerateRequest
from tests.fakes import FakeTransport, FakeUpstream, make_state

LIMITS = ConnectionLimits(max_frame_bytes=4096)


def attach(
    state: ServerState, limits: ConnectionLimits = LIMITS, turns: TurnQueue | None = None
) -> tuple[GovernorProtocol, FakeTransport]:
    protocol = GovernorProtocol(state, limits, TurnQueue() if turns is None else turns)
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


def connect(upstream: FakeUpstream, max_inflight: int = 4) -> tuple[GovernorProtocol, FakeTransport, Any]:
    state = make_state(max_inflight=max_inflight, upstream=upstream)
    protocol, transport = attach(state)
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
    assert state.admission.inflight.inflight == 0
    assert state.accounting.failed["internal"] == 1
    assert state.accounting.unbalanced_by(0) == 0
    assert not state.connections


def test_eof_settles_in_flight_requests_at_once() -> None:
    upstream = FakeUpstream()
    protocol, transport, state = connect(upstream)
    protocol.data_received(encode(generate_frame("a", "x")))
    assert state.admission.inflight.inflight == 1
    assert protocol.eof_received() is None  # our side closes too
    assert state.admission.inflight.inflight == 0
    assert upstream.sent_frames == [{"id": "1", "op": "cancel"}]
    assert state.accounting.failed["client_disconnected"] == 1


def test_a_flood_in_one_read_is_answered_over_later_turns_and_not_read_meanwhile() -> None:
    async def scenario() -> None:
        protocol, transport, state = connect(FakeUpstream(), max_inflight=1)
        n = 3 * FRAMES_PER_TURN
        protocol.data_received(b"".join(encode(generate_frame(f"r{i}", "x")) for i in range(n)))
        assert len(transport.replies()) == FRAMES_PER_TURN - 1 and not transport.reading
        for _ in range(5):
            await asyncio.sleep(0)  # other connections' reads and the workers' tokens run between
        assert len(transport.replies()) == n - 1 and transport.reading
        assert state.accounting.unbalanced_by(1) == 0

    asyncio.run(scenario())


def test_a_read_that_lands_while_frames_wait_queues_behind_them_one_slice_per_turn() -> None:
    async def scenario() -> None:
        protocol, transport, _ = connect(FakeUpstream(), max_inflight=1)
        frames = [encode(generate_frame(f"r{i}", "x")) for i in range(4 * FRAMES_PER_TURN)]
        protocol.data_received(b"".join(frames[: 2 * FRAMES_PER_TURN]))
        protocol.data_received(b"".join(frames[2 * FRAMES_PER_TURN :]))  # (a transport may still deliver)
        answered = [len(transport.replies())]
        for _ in range(4):
            await asyncio.sleep(0)
            answered.append(len(transport.replies()))
        assert [b - a for a, b in zip(answered, answered[1:], strict=False)] == [FRAMES_PER_TURN] * 3 + [0]
        assert [r["id"] for r in transport.replies()] == [f"r{i}" for i in range(1, 4 * FRAMES_PER_TURN)]

    asyncio.run(scenario())


def test_frames_held_by_many_connections_are_answered_a_turns_worth_per_turn_in_all() -> None:
    """Four connections each hold a read's worth of frames: the queue answers FRAMES_PER_TURN a
    turn over all of them, each connection's in order, and reads them again once done."""

    async def scenario() -> None:
        state, turns = make_state(max_inflight=1, upstream=FakeUpstream()), TurnQueue()
        clients = [attach(state, turns=turns) for _ in range(4)]
        for c, (protocol, _) in enumerate(clients):
            read = [encode(generate_frame(f"c{c}r{i}", "x")) for i in range(FRAMES_PER_TURN + 40)]
            protocol.data_received(b"".join(read))  # its first slice is answered inside the read

        def answered() -> int:
            return sum(len(t.replies()) for _, t in clients)

        counts = [answered()]
        while len(turns):
            await asyncio.sleep(0)
            counts.append(answered())
        steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
        assert all(0 < s <= FRAMES_PER_TURN for s in steps) and len(steps) >= 4 * 40 / FRAMES_PER_TURN
        assert counts[-1] == 4 * (FRAMES_PER_TURN + 40) - 1
        for _, transport in clients:
            ids = [r["id"] for r in transport.replies()]
            assert ids == sorted(ids, key=lambda i: int(i.split("r")[1])) and transport.reading
        assert state.accounting.unbalanced_by(1) == 0

    asyncio.run(scenario())


def test_a_connection_refused_again_and_again_is_answered_in_the_queue_not_in_its_read() -> None:
    async def scenario() -> None:
        turns = TurnQueue()
        protocol, transport = attach(make_state(max_inflight=1, upstream=FakeUpstream()), turns=turns)
        protocol.data_received(b"".join(encode(generate_frame(f"r{i}", "x")) for i in range(DEFER_AFTER_REFUSED + 1)))
        assert len(transport.replies()) == DEFER_AFTER_REFUSED and transport.reading
        protocol.data_received(encode(generate_frame("storm", "x")))
        assert len(transport.replies()) == DEFER_AFTER_REFUSED and not transport.reading and len(turns) == 1
        await asyncio.sleep(0)
        # (refused for good: the one in flight is forecast at 16 tokens x 0.1 s = 1.6 s, past the 1 s horizon)
        storm = {"id": "storm", "status": "yield", "retry_hint_ms": ANY, "reason": ANY, "final": True}
        assert transport.replies()[-1] == storm
        assert transport.reading and not len(turns)

    asyncio.run(scenario())


def test_eof_answers_the_frames_still_waiting_for_their_turn_first() -> None:
    async def scenario() -> None:
        protocol, transport, state = connect(FakeUpstream(), max_inflight=1)
        n = 2 * FRAMES_PER_TURN
        protocol.data_received(b"".join(encode(generate_frame(f"r{i}", "x")) for i in range(n)))
        assert protocol.eof_received() is None
        assert len(transport.replies()) == n - 1 and state.accounting.received == n
        assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0

    asyncio.run(scenario())


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


def test_a_connection_over_max_connections_is_refused_with_a_typed_reply() -> None:
    state = make_state()
    limits = ConnectionLimits(max_frame_bytes=4096, max_connections=1)
    _, first = attach(state, limits)
    refused, second = attach(state, limits)
    assert not first.closed and second.closed
    assert second.replies() == [{"id": None, "status": "error", "code": "too_many_connections", "message": ANY}]
    refused.data_received(encode(generate_frame("a", "x")))  # nothing is read from a refused connection
    assert state.accounting.shed["max_connections"] == 1 and len(state.connections) == 1
    assert state.accounting.received == 0


def test_idle_connections_are_closed_but_not_while_a_request_is_in_flight() -> None:
    state = make_state()
    limits = ConnectionLimits(max_frame_bytes=4096, idle_timeout_s=60)
    busy, busy_transport = attach(state, limits)
    idle, idle_transport = attach(state, limits)
    busy.data_received(encode(generate_frame("a", "x")))
    state.clock.advance(61)  # type: ignore[attr-defined]
    for protocol in (busy, idle):
        protocol.check_timeouts(state.clock())
    assert idle_transport.closed and idle_transport.replies()[-1]["code"] == "idle_timeout"
    assert not busy_transport.closed
    assert state.accounting.shed["idle_timeout"] == 1
    busy.data_received(b"\n")  # a blank line is a keep-alive: it restarts the idle clock
    assert busy.ingress is not None and busy.ingress.last_line_at == state.clock()


def test_past_the_total_buffer_cap_the_connection_holding_most_is_shed() -> None:
    state = make_state()
    limits = ConnectionLimits(max_frame_bytes=4096, max_buffer_bytes=100)
    big, big_transport = attach(state, limits)
    small, small_transport = attach(state, limits)
    big.data_received(b'{"id":"a","prompt":"' + b"x" * 60)  # no newline yet: held
    assert state.buffered_bytes == 80
    small.data_received(b"y" * 30)
    assert big_transport.closed and big_transport.replies()[-1]["code"] == "buffer_full"
    assert not small_transport.closed and state.buffered_bytes == 30
    small.connection_lost(None)
    assert state.buffered_bytes == 0 and state.accounting.shed["buffer_bytes"] == 1


def test_a_client_that_stops_reading_is_cut_past_the_write_buffer_cap() -> None:
    async def scenario() -> None:
        upstream = FakeUpstream()
        state = make_state(upstream=upstream)
        protocol, transport = attach(state, ConnectionLimits(max_frame_bytes=4096, max_write_buffer_bytes=1000))
        protocol.data_received(encode(generate_frame("a", "x", max_new_tokens=50)))
        protocol.pause_writing()
        transport.unsent = 999
        upstream.worker_sends({"id": "1", "status": "token", "index": 0, "text": "x"})
        await asyncio.sleep(0)
        assert not transport.closed  # at the cap, not past it
        transport.unsent = 1001
        upstream.worker_sends({"id": "1", "status": "token", "index": 1, "text": "x"})
        await asyncio.sleep(0)
        assert transport.aborted  # a graceful close would wait on a peer that does not read
        assert state.admission.inflight.inflight == 0 and upstream.sent_frames == [{"id": "1", "op": "cancel"}]
        assert state.accounting.failed["connection_shed"] == 1 and state.accounting.shed["write_buffer"] == 1
        assert state.accounting.unbalanced_by(0) == 0

    asyncio.run(scenario())


SECRET = TenantSecrets.from_text("s3cret", "test")


def test_with_auth_the_first_frame_must_carry_the_token() -> None:
    state = make_state(auth=SECRET)
    protocol, transport = attach(state)
    protocol.data_received(encode(generate_frame("a", "x")) + encode(generate_frame("b", "x")))
    assert [r.get("code") for r in transport.replies()] == ["unauthorized"]  # the second is never read
    assert transport.closed and state.accounting.shed["unauthorized"] == 1 and state.admission.inflight.inflight == 0
    assert state.accounting.rejected["unauthorized"] == 1 and state.accounting.unbalanced_by(0) == 0

    protocol, transport = attach(state)
    protocol.data_received(b'{"op":"auth","token":"wrong"}\n')
    assert transport.closed and transport.replies()[0]["code"] == "unauthorized"
    assert b"wrong" not in bytes(transport.written)


def test_a_matching_auth_frame_opens_the_connection_for_what_follows() -> None:
    state = make_state(auth=SECRET)
    protocol, transport = attach(state)
    protocol.data_received(b'\n{"id":"k","op":"auth","token":"s3cret"}\n' + encode(generate_frame("a", "x", ack=True)))
    assert transport.replies() == [{"id": "k", "status": "authenticated"}, {"id": "a", "status": "accepted"}]
    assert not transport.closed and state.admission.inflight.inflight == 1


def test_with_auth_a_connection_must_authenticate_in_time_and_blank_lines_do_not_extend_it() -> None:
    state = make_state(auth=SECRET)
    slow, slow_transport = attach(state)
    quick, quick_transport = attach(state)
    quick.data_received(b'{"op":"auth","token":"s3cret"}\n')
    for _ in range(11):
        state.clock.advance(1)  # type: ignore[attr-defined]
        slow.data_received(b"\n")
        for protocol in (slow, quick):
            protocol.check_timeouts(state.clock())
    assert slow_transport.closed and slow_transport.replies()[-1]["code"] == "unauthorized"
    assert not quick_transport.closed and state.accounting.shed["unauthorized"] == 1


def test_before_auth_only_an_auth_sized_line_is_held_and_a_big_frame_may_follow_it() -> None:
    state = make_state(auth=SECRET)
    protocol, transport = attach(state, ConnectionLimits(max_frame_bytes=1 << 20))
    big = encode(generate_frame("big", "x" * 100_000))
    protocol.data_received(b'{"op":"auth","token":"s3cret"}\n' + big)  # pipelined behind the auth frame
    assert [r["status"] for r in transport.replies()] == ["authenticated"] and state.admission.inflight.inflight == 1
    hog, hog_transport = attach(state, ConnectionLimits(max_frame_bytes=1 << 20))
    hog.data_received(b'{"op":"auth","token":"' + b"A" * 40_000)  # never a newline
    assert hog_transport.closed and hog.buffered_bytes == 0 and state.buffered_bytes == 0


def test_an_auth_frame_needs_no_id_even_after_the_connection_is_open() -> None:
    state = make_state()  # auth off: any auth frame is welcome
    protocol, transport = attach(state)
    protocol.data_received(b'{"op":"auth","token":"whatever"}\n{"id":"x","op":"auth"}\n')
    assert transport.replies() == [{"id": None, "status": "authenticated"}, {"id": "x", "status": "authenticated"}]
    assert state.accounting.received == 0


def test_a_connection_that_fails_in_its_turn_is_closed_and_the_others_keep_their_turns() -> None:
    class Broken:
        held_frames = 5
        closed = False

        def next_slice(self, budget: int) -> tuple[int, bool]:
            raise RuntimeError("a bug")

        def close(self) -> None:
            self.closed = True

    async def scenario() -> None:
        state, turns = make_state(max_inflight=1, upstream=FakeUpstream()), TurnQueue()
        broken = Broken()
        turns.add(broken)
        protocol, transport = attach(state, turns=turns)
        protocol.data_received(b"".join(encode(generate_frame(f"r{i}", "x")) for i in range(FRAMES_PER_TURN + 5)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert broken.closed and not len(turns)
        assert len(transport.replies()) == FRAMES_PER_TURN + 4 and transport.reading

    asyncio.run(scenario())
