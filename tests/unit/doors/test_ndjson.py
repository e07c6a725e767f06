from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from governor.accounting import Outcome
from governor.admission.caps import Caps
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintPolicy
from governor.doors.ndjson import DEFER_AFTER_REFUSED, Ingress
from governor.doors.turns import FRAMES_PER_TURN
from governor.lifecycle import LifecycleError, Phase
from govwire.codec import encode, encode_token, generate_frame
from govwire.request import IntegrityMode
from tests.fakes import FakeClock, FakeUpstream, done_frame, make_ingress, make_state


def frame(rid: str, prompt: str = "hi", **fields: Any) -> bytes:
    return encode(generate_frame(rid, prompt, **fields))


def replies(writes: Any) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in writes.lines()]


def test_yield_is_written_in_the_same_call_and_byte_exact() -> None:
    state = make_state(max_inflight=1, hint_policy=RetryHintPolicy(jitter=0.0))
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", stop_on_eos=False) + frame("b"))
    # a's release is forecast from its own 16 tokens (the frame's default max_new_tokens, all of
    # them: it runs to its length) at the prior 0.1 s a token: a first token a step after
    # admission, 15 steps more = 1.6 s, past the 1 s promise horizon: b is refused for good (no ticket, `"final":true`).
    assert writes.chunks == [b'{"id":"b","status":"yield","retry_hint_ms":1600,"reason":"inflight","final":true}\n']
    assert state.admission.inflight.inflight == 1
    assert state.accounting.yielded["inflight"] == 1 and state.accounting.final["inflight"] == 1


def test_a_read_of_many_frames_is_answered_in_slices_in_order() -> None:
    """At most FRAMES_PER_TURN frames per call: the rest wait for `resume`, in order, one write
    per slice, every frame counted once."""
    state = make_state(max_inflight=1)
    ingress, writes = make_ingress(state)
    n = 3 * FRAMES_PER_TURN + 5
    ingress.receive_data(b"".join(frame(f"r{i}") for i in range(n)))
    assert len(replies(writes)) == FRAMES_PER_TURN - 1  # the first was admitted: its reply comes later
    assert ingress.held_frames == n - FRAMES_PER_TURN
    slices = 1
    while ingress.held_frames:
        ingress.resume(FRAMES_PER_TURN)
        slices += 1
    assert slices == 4 and len(writes.chunks) == 4
    assert [r["id"] for r in replies(writes)] == [f"r{i}" for i in range(1, n)]
    assert state.accounting.received == n and state.accounting.unbalanced_by(1) == 0


def test_a_connection_refused_again_and_again_waits_for_its_turn_until_one_frame_gets_in() -> None:
    """After DEFER_AFTER_REFUSED refusals in a row a read is only held (the turn queue answers it
    later); an admitted frame makes the connection's reads answered at once again."""
    upstream = FakeUpstream()
    state = make_state(max_inflight=1, upstream=upstream)
    holder, _ = make_ingress(state)
    holder.receive_data(frame("held"))
    ingress, writes = make_ingress(state)
    ingress.receive_data(b"".join(frame(f"r{i}") for i in range(DEFER_AFTER_REFUSED)))
    assert len(replies(writes)) == DEFER_AFTER_REFUSED and ingress.held_frames == 0
    ingress.receive_data(frame("late"))
    assert len(replies(writes)) == DEFER_AFTER_REFUSED and ingress.held_frames == 1
    ingress.receive_data(frame("later"))  # behind it
    ingress.resume(1)
    assert replies(writes)[-1]["id"] == "late" and ingress.held_frames == 1
    ingress.resume(FRAMES_PER_TURN)
    upstream.worker_sends(done_frame("1", "x", "eos"))  # the held slot frees
    ingress.receive_data(frame("late"))  # retried: still held first, then admitted at its turn
    assert ingress.held_frames == 1 and "late" not in ingress.active
    ingress.resume(FRAMES_PER_TURN)
    assert ingress.held_frames == 0 and "late" in ingress.active
    ingress.receive_data(frame("now"))  # admitted once: answered inside the read again
    assert replies(writes)[-1]["id"] == "now" and replies(writes)[-1]["status"] == "yield"
    assert state.accounting.unbalanced_by(1) == 0


def test_replies_for_one_read_leave_in_one_write() -> None:
    state = make_state(max_inflight=1)
    ingress, writes = make_ingress(state)
    ingress.receive_data(b"".join(frame(f"r{i}") for i in range(10)) + b"garbage\n")
    assert len(writes.chunks) == 1
    statuses = [r["status"] for r in replies(writes)]
    assert statuses == ["yield"] * 9 + ["error"]


def test_each_bad_input_gets_its_code_and_the_connection_keeps_serving() -> None:
    state = make_state(max_inflight=4, max_new_tokens=8)
    ingress, writes = make_ingress(state, max_frame_bytes=200)
    bad = [
        (b"{nope\n", "bad_json", None),
        (b'{"id":"x","op":"generate"}\n', "bad_frame", "x"),
        (b"x" * 300 + b"\n", "frame_too_large", None),
        (encode({**generate_frame("i", "abc"), "sha256": "0" * 64}), "integrity", "i"),
        (b'{"id":"u","op":"reboot"}\n', "unknown_op", "u"),
        (frame("m", max_new_tokens=9), "bad_frame", "m"),
    ]
    for data, code, rid in bad:
        ingress.receive_data(data)
        reply = replies(writes)[-1]
        assert (reply["status"], reply["code"], reply["id"]) == ("error", code, rid)
    ingress.receive_data(frame("dup"))
    ingress.receive_data(frame("dup"))
    assert replies(writes)[-1]["code"] == "duplicate_id"
    assert state.admission.inflight.inflight == 1  # the integrity failure's slot was refunded; "dup" holds one
    ingress.receive_data(b'{"id":"p","op":"ping"}\n')
    assert replies(writes)[-1] == {"id": "p", "status": "pong", "protocol": 1}
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0
    assert state.accounting.rejected["bad_frame"] == 2


def test_worker_frames_are_readdressed_and_done_settles_the_slot() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(clock=clock, upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("client-id", "ab"))
    (uid,) = upstream.dispatched
    request, generate = upstream.dispatched[uid]
    assert generate.prompt == "ab" and request.client_id == "client-id"
    clock.advance(0.01)
    upstream.worker_sends({"id": uid, "status": "token", "index": 0, "token_id": 97, "text": "a"})
    clock.advance(0.02)
    upstream.worker_sends(
        {
            "id": uid,
            "status": "done",
            "text": "a",
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "finish_reason": "length",
            "queue_wait_ms": 0.0,
        },
    )
    token, done = replies(writes)
    assert token == {"id": "client-id", "status": "token", "index": 0, "token_id": 97, "text": "a"}
    assert done["id"] == "client-id" and done["finish_reason"] == "length"
    assert done["ttft_ms"] == 10.0 and done["total_ms"] == 30.0
    assert state.admission.inflight.inflight == 0 and state.accounting.executed == 1
    assert state.admission.hints.service_time_s == pytest.approx(0.03)


def test_a_client_cancel_reaches_the_worker_and_is_answered_by_the_final_reply() -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a") + b'{"id":"a","op":"cancel"}\n{"id":"gone","op":"cancel"}\n')
    assert upstream.sent_frames == [{"id": "1", "op": "cancel"}]  # "gone" is not in flight: ignored
    assert writes.chunks == [] and state.admission.inflight.inflight == 1
    upstream.worker_sends(done_frame("1", "", "cancelled"))
    assert replies(writes)[-1]["finish_reason"] == "cancelled" and state.admission.inflight.inflight == 0
    assert state.accounting.received == 1 and state.accounting.unbalanced_by(0) == 0


def test_a_token_frame_is_readdressed_as_bytes_exactly_as_if_parsed() -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame('client "7"'))
    request, _ = upstream.dispatched["1"]
    upstream.worker_sends(encode_token("1", 0, 104, "é\n"))
    assert writes.chunks[-1] == encode_token('client "7"', 0, 104, "é\n")
    assert request.t_first_token is not None and request.generate is None


def test_a_token_frame_in_another_key_order_is_parsed_and_readdressed_the_same() -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("c"))
    request, _ = upstream.dispatched["1"]
    upstream.worker_sends({"status": "token", "text": "é", "index": 0, "token_id": 104, "id": "1"})
    assert orjson.loads(writes.chunks[-1]) == {"id": "c", "status": "token", "index": 0, "token_id": 104, "text": "é"}
    assert request.phase is Phase.STARTED and request.tokens_seen == 1


def test_stream_false_drops_tokens_but_keeps_the_done() -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("q", stream=False))
    upstream.worker_sends({"id": "1", "status": "token", "index": 0, "token_id": 1, "text": "h"})
    upstream.worker_sends(done_frame("1", "h", "eos"))
    assert [r["status"] for r in replies(writes)] == ["done"]


def test_ack_answers_accepted_at_admission_and_is_not_forwarded() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=2, upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a", ack=True) + frame("bad", ack="yes") + frame("b") + frame("c", ack=True))
    statuses = [(r["id"], r["status"], r.get("code")) for r in replies(writes)]
    assert statuses == [("a", "accepted", None), ("bad", "error", "bad_frame"), ("c", "yield", None)]
    assert [g.ack for _, g in upstream.dispatched.values()] == [True, False]
    assert all("ack" not in g.to_frame() for _, g in upstream.dispatched.values())


def test_worker_error_codes_are_counted_as_failed_or_rejected() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=3, upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a") + frame("b"))
    upstream.worker_sends({"id": "1", "status": "error", "code": "bad_frame", "message": "m"})
    state.admission.pool.endpoints[0].up = False  # as a lost link marks it: no endpoint to re-route to
    state.lifecycle.lose(upstream.dispatched["2"][0], "gone")
    ingress.flush()
    assert [(r["id"], r["code"]) for r in replies(writes)] == [("a", "bad_frame"), ("b", "worker_lost")]
    assert state.accounting.rejected["bad_frame"] == 1 and state.accounting.failed["worker_lost"] == 1
    assert state.admission.inflight.inflight == 0


def test_no_worker_means_worker_unavailable_and_no_slot_held() -> None:
    upstream = FakeUpstream()
    upstream.available = False
    state = make_state(upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a"))
    assert replies(writes)[0]["code"] == "worker_unavailable"
    assert state.admission.inflight.inflight == 0 and state.accounting.failed["worker_unavailable"] == 1


def test_disconnect_frees_slots_and_cancels_in_the_worker() -> None:
    upstream = FakeUpstream()
    state = make_state(upstream=upstream)
    ingress, _ = make_ingress(state)
    ingress.receive_data(frame("a") + frame("b"))
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0
    assert sorted(f["id"] for f in upstream.sent_frames) == ["1", "2"]
    assert state.accounting.failed["client_disconnected"] == 2
    assert state.accounting.unbalanced_by(0) == 0


def test_a_request_is_settled_at_most_once() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=2, upstream=upstream)
    ingress, _ = make_ingress(state)
    ingress.receive_data(frame("a") + frame("b"))
    request = upstream.dispatched["1"][0]
    state.lifecycle.settle(request, Outcome.EXECUTED)
    with pytest.raises(LifecycleError, match="settled twice"):
        state.lifecycle.settle(request, Outcome.FAILED, "worker_lost")  # must not free b's slot
    assert state.admission.inflight.inflight == 1 and list(ingress.active) == ["b"]
    assert (state.accounting.executed, state.accounting.failed["worker_lost"]) == (1, 0)


def test_draining_yields_with_reason_draining() -> None:
    state = make_state()
    state.admission.start_draining()
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a"))
    assert replies(writes)[0]["reason"] == "draining"
    assert state.admission.inflight.inflight == 0


def test_stats_reports_the_counters() -> None:
    state = make_state(max_inflight=1)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a") + frame("b") + b'{"id":"s","op":"stats"}\n')
    stats = replies(writes)[-1]
    assert stats["status"] == "stats"
    assert (stats["inflight"], stats["max_inflight"], stats["yielded_total"], stats["received_total"]) == (1, 1, 1, 2)


# Streams mixing valid frames (admitted, yielded, duplicate ids), control frames and garbage.
_pieces = st.one_of(
    st.binary(max_size=120),
    st.builds(lambda i, p: frame(f"r{i}", p, max_new_tokens=2), st.integers(0, 5), st.text(max_size=10)),
    st.sampled_from([b'{"id":"p","op":"ping"}\n', b'{"id":"s","op":"stats"}\n', b"\n", b"\r\n", b'{"id":7}\n']),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_pieces, max_size=12), st.data())
def test_any_bytes_get_a_reply_per_line_and_never_raise(pieces: list[bytes], data: st.DataObject) -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=2, integrity=IntegrityMode.OPTIONAL, upstream=upstream)
    ingress, writes = make_ingress(state, max_frame_bytes=300)
    stream = b"".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        ingress.receive_data(stream[a:b])
    *complete, tail = stream.split(b"\n")
    expected = sum(1 for line in complete if line not in (b"", b"\r")) + (len(tail) > 300)
    assert len(writes.lines()) + len(upstream.dispatched) == expected
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0


class IngressMachine(RuleBasedStateMachine):
    """Several connections, arbitrary interleavings of frames, completions and disconnects."""

    def __init__(self) -> None:
        super().__init__()
        self.upstream = FakeUpstream()
        self.state = make_state(max_inflight=3, upstream=self.upstream)
        self.conns: list[Ingress] = [make_ingress(self.state)[0] for _ in range(3)]
        self.n = 0

    @rule(conn=st.integers(0, 2), count=st.integers(1, 6))
    def send(self, conn: int, count: int) -> None:
        data = b""
        for _ in range(count):
            self.n += 1
            data += frame(f"r{self.n}")
        self.conns[conn].receive_data(data)

    @rule(conn=st.integers(0, 2), rid=st.integers(1, 20))
    def send_maybe_duplicate(self, conn: int, rid: int) -> None:
        self.conns[conn].receive_data(frame(f"r{rid}"))

    @precondition(lambda self: self.state.admission.inflight.inflight > 0)
    @rule(data=st.data())
    def worker_streams_a_token(self, data: st.DataObject) -> None:
        live = [r for c in self.conns for r in c.active.values()]
        request = data.draw(st.sampled_from(live))
        self.upstream.worker_sends(encode_token(request.uid, 0, 97, "a"))
        assert request.phase is Phase.STARTED and request.t_first_token is not None

    @precondition(lambda self: self.upstream.dispatched)
    @rule(data=st.data())
    def an_illegal_transition_is_refused_and_changes_nothing(self, data: st.DataObject) -> None:
        request, generate = data.draw(st.sampled_from(list(self.upstream.dispatched.values())))
        phase = request.phase
        with pytest.raises(LifecycleError):
            if phase is Phase.SETTLED:
                self.state.lifecycle.settle(request, Outcome.EXECUTED)
            else:
                self.state.lifecycle.dispatch(request, generate)  # dispatched already
        assert request.phase is phase

    @precondition(lambda self: self.state.admission.inflight.inflight > 0)
    @rule(data=st.data(), ok=st.booleans())
    def worker_finishes_one(self, data: st.DataObject, ok: bool) -> None:
        live = [r for c in self.conns for r in c.active.values()]
        request = data.draw(st.sampled_from(live))
        if ok:
            self.upstream.worker_sends(done_frame(request.uid, "", "eos"))
        else:
            self.state.lifecycle.lose(request, "gone")

    @rule(conn=st.integers(0, 2))
    def disconnect(self, conn: int) -> None:
        self.conns[conn].connection_lost()
        self.conns[conn] = make_ingress(self.state)[0]

    @invariant()
    def cap_holds_and_counters_balance(self) -> None:
        inflight = self.state.admission.inflight.inflight
        assert 0 <= inflight <= 3
        assert inflight == sum(len(c.active) for c in self.conns)
        assert self.state.accounting.unbalanced_by(inflight) == 0
        assert self.state.admission.pool.endpoints[0].inflight == inflight

    @invariant()
    def every_request_is_in_the_phase_its_replies_say(self) -> None:
        live = {id(r) for c in self.conns for r in c.active.values()}
        for request, _ in self.upstream.dispatched.values():
            if id(request) in live:  # between replies: with a worker, started once a token came
                assert request.phase in (Phase.DISPATCHED, Phase.STARTED)
                assert (request.phase is Phase.STARTED) == (request.t_first_token is not None)
            else:  # its final reply was written (or its connection is gone)
                assert request.phase is Phase.SETTLED
                assert request.uid not in self.upstream.link.inflight


TestIngressMachine = IngressMachine.TestCase
TestIngressMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_pool_limits_yield_with_their_reason_and_an_exact_qps_hint() -> None:
    clock = FakeClock(start=0.0)
    endpoint = Endpoint("w", EndpointLimits(concurrency=1), 0.0)
    endpoint.up = True
    state = make_state(max_inflight=8, clock=clock, endpoints=[endpoint])
    state.admission.set_caps(Caps(max_inflight=8, max_qps=2.0, qps_burst=2.0), now=0.0)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("a") + frame("b"))
    assert [r.get("reason") for r in replies(writes)] == ["endpoint_inflight"]  # "a" holds the only slot
    ingress.receive_data(frame("bad", max_new_tokens="x"))  # yielded before validation, as documented
    assert replies(writes)[-1]["reason"] == "endpoint_inflight"
    endpoint.limits = EndpointLimits(concurrency=4)
    ingress.receive_data(frame("bad", max_new_tokens="x"))
    assert replies(writes)[-1]["code"] == "bad_frame"
    bucket = state.admission.rate.bucket
    assert bucket is not None and bucket.level(0.0) == 1.0  # the invalid frame's token came back
    ingress.receive_data(frame("c") + frame("d"))
    last = replies(writes)[-1]
    assert {k: last[k] for k in ("id", "status", "retry_hint_ms", "reason")} == {
        "id": "d",
        "status": "yield",
        "retry_hint_ms": 500,  # the next token, exactly
        "reason": "qps",
    }
    assert last["retry_ticket"] and bucket.level(0.0) == -1.0  # paid for at once: kept for "d"
    assert state.admission.inflight.inflight == 2 and endpoint.inflight == 2
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_a_priority_of_the_wrong_type_is_bad_frame_not_an_internal_error() -> None:
    state = make_state(integrity=IntegrityMode.OFF)
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("p", priority=[1]))
    (reply,) = replies(writes)
    assert reply["code"] == "bad_frame" and "priority" in reply["message"]
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


@pytest.mark.parametrize("junk", [7, None, ["t"], {"t": 1}, "", "x" * 1000])
def test_a_retry_ticket_of_any_shape_is_no_ticket_never_an_error(junk: Any) -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(max_inflight=1, upstream=upstream, clock=clock, hint_policy=RetryHintPolicy(jitter=0.0))
    ingress, writes = make_ingress(state)
    # 2 tokens (all: it runs to its length) at the prior 0.1 s a token: forecast to end 0.2 s
    # after its admission (b's slot; c's is the round after, 0.4 s: both within the 1 s horizon, both booked)
    ingress.receive_data(frame("hold", max_new_tokens=2, stop_on_eos=False))
    ingress.receive_data(frame("b") + frame("c", "other", retry_ticket=junk))
    b, c = replies(writes)
    # told to be back by 1 ms before the release (the lobby's "be here by": lateness 0 + 1 ms)
    assert (b["status"], b["retry_hint_ms"]) == ("yield", 199) and b["retry_ticket"]
    assert c["status"] == "yield" and c["retry_ticket"] != b["retry_ticket"]  # a client of its own
    assert state.accounting.rejected_total == 0
    clock.advance(0.2)
    (uid,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid, "done", completion_tokens=1))
    # c, with junk for a ticket, is not b: the slot kept for b is not c's
    ingress.receive_data(frame("c", "other", retry_ticket=junk))
    assert replies(writes)[-1]["status"] == "yield"
    ingress.receive_data(frame("x", "new", retry_ticket=b["retry_ticket"]))  # b's ticket, another frame
    assert len(upstream.dispatched) == 2
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0


def test_a_frame_with_a_retry_ticket_is_a_retry_and_blind_without_its_appointment() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    state = make_state(max_inflight=1, upstream=upstream, clock=clock, hint_policy=RetryHintPolicy(jitter=0.0))
    ingress, writes = make_ingress(state)
    ingress.receive_data(frame("hold", max_new_tokens=2, stop_on_eos=False) + frame("b"))
    (b,) = replies(writes)
    assert b["status"] == "yield" and b["retry_ticket"]
    ingress.receive_data(frame("stale", "other", retry_ticket="t-unknown"))  # a ticket nobody booked
    clock.advance(0.2)
    (uid,) = upstream.dispatched
    upstream.worker_sends(done_frame(uid, "done", completion_tokens=1))
    ingress.receive_data(frame("b", retry_ticket=b["retry_ticket"]))  # back for its appointment
    assert replies(writes)[-1]["status"] != "yield"
    accounting = state.accounting
    assert accounting.attempts == {"first": {"admitted": 1, "yielded": 1}, "retry": {"admitted": 1, "yielded": 1}}
    assert accounting.blind_retries == {"admitted": 0, "yielded": 1}  # the stale ticket's
    assert accounting.unbalanced_by(state.admission.inflight.inflight) == 0
