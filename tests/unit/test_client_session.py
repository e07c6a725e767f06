"""The clients' sans-IO core: reply routing, attribution of id-less replies, retry decisions."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.client import ConnectionLost, Result, RetryBudget, RetryPolicy, Token, Yielded
from governor.client.retry import Attempts
from governor.client.session import ACCEPTED, Session, request_ids
from govwire.errors import FrameTooLarge, IntegrityMismatch, WorkerLost, WorkerUnavailable


def line(**reply: object) -> bytes:
    return orjson.dumps(reply) + b"\n"


def test_replies_become_tokens_results_and_typed_failures_for_their_own_request() -> None:
    session = Session(request_ids())
    a, frame = session.generate("hi", {"max_new_tokens": 2})
    b, _ = session.generate("yo", {})
    sent = orjson.loads(frame)
    assert sent["ack"] is True and sent["size"] == 2 and len(sent["sha256"]) == 64
    events = session.feed(
        line(id=a, status="accepted")
        + line(id=b, status="yield", retry_hint_ms=40, reason="inflight")
        + line(id=a, status="token", index=0, token_id=104, text="h")
        + line(id=a, status="done", text="hi", finish_reason="length", prompt_tokens=2, completion_tokens=2)
    )
    (rid_a, accepted), (rid_b, yielded), (rid_t, token), (rid_d, done) = events
    assert (rid_a, accepted) == (a, ACCEPTED)
    assert rid_b == b and isinstance(yielded, Yielded) and (yielded.retry_hint_ms, yielded.reason) == (40, "inflight")
    assert (rid_t, token) == (a, Token(0, 104, "h"))
    assert rid_d == a and isinstance(done, Result) and done.text == "hi" and done.completion_tokens == 2
    assert session.open == set()  # both are final


def test_a_yield_s_ticket_is_read_and_a_retry_sends_it_back() -> None:
    session = Session(request_ids())
    a, _ = session.generate("hi", {})
    ((_, yielded),) = session.feed(line(id=a, status="yield", retry_hint_ms=40, reason="inflight", retry_ticket="t1"))
    assert isinstance(yielded, Yielded) and yielded.retry_ticket == "t1"
    _, retry = session.generate("hi", {}, retry_ticket=yielded.retry_ticket)
    assert orjson.loads(retry)["retry_ticket"] == "t1"
    with pytest.raises(TypeError):
        session.generate("hi", {"retry_ticket": "mine"})  # the client sends tickets itself


def test_an_id_less_error_belongs_to_the_oldest_frame_without_a_first_reply() -> None:
    session = Session(request_ids())
    a, _ = session.generate("x" * 10, {})
    b, _ = session.generate("y", {})
    events = session.feed(
        line(id=a, status="accepted") + line(id=None, status="error", code="frame_too_large", message="big")
    )
    assert events[0] == (a, ACCEPTED)
    rid, error = events[1]
    assert rid == b and isinstance(error, FrameTooLarge)  # a was acknowledged: the null reply is b's


def test_a_cancelled_request_hears_nothing_more_and_its_final_reply_is_dropped() -> None:
    session = Session(request_ids())
    a, _ = session.generate("x", {})
    assert orjson.loads(session.cancel(a)) == {"id": a, "op": "cancel"}
    assert session.feed(line(id=a, status="done", text="", finish_reason="cancelled")) == []


def test_control_replies_come_back_raw_and_errors_are_typed_per_code() -> None:
    session = Session(request_ids())
    p, _ = session.control("ping")
    g, _ = session.generate("x", {})
    events = dict(session.feed(line(id=p, status="pong", protocol=1) + line(id=g, status="error", code="integrity")))
    assert events[p] == {"id": p, "status": "pong", "protocol": 1}
    assert isinstance(events[g], IntegrityMismatch)


def test_an_unreadable_reply_breaks_the_session_after_delivering_what_came_before() -> None:
    session = Session(request_ids())
    a, _ = session.generate("x", {})
    events = session.feed(line(id=a, status="accepted") + b"not json\n" + line(id=a, status="done"))
    assert events == [(a, ACCEPTED)] and isinstance(session.broken, ConnectionLost)
    oversized = Session(request_ids())
    oversized._splitter.max_frame_bytes = 16  # noqa: SLF001  (the 64 MiB limit, shrunk)
    assert oversized.feed(b"x" * 32 + b"\n") == [] and oversized.broken is not None
    http = Session(request_ids())  # pointed at the front door by mistake: it says so
    assert http.feed(b"HTTP/1.1 400 Bad Request\r\n") == []
    assert "--port" in str(http.broken) and "NDJSON" in str(http.broken)


def test_an_id_less_reply_goes_to_the_head_even_when_the_head_was_given_up_on() -> None:
    session = Session(request_ids())
    a, _ = session.generate("x" * 10, {})
    b, _ = session.generate("y", {})
    session.cancel(a)  # before a's first reply: its frame_too_large must not be blamed on b
    too_large = line(id=None, status="error", code="frame_too_large", message="big")
    assert session.feed(too_large + line(id=b, status="accepted")) == [(b, ACCEPTED)]


def test_ids_are_never_reused_across_the_sessions_of_one_client_and_reserved_fields_are_refused() -> None:
    ids = request_ids()
    first, second = Session(ids), Session(ids)
    assert first.generate("x", {})[0] != second.generate("x", {})[0]
    with pytest.raises(TypeError, match="id"):
        first.generate("x", {"id": "mine"})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_attempts_wait_the_hint_with_jitter_and_stop_at_the_limits() -> None:
    clock = Clock()
    policy = RetryPolicy(max_attempts=3, deadline_s=10.0, jitter=0.2)
    attempts = Attempts(policy, RetryBudget(0.0, 100.0), clock, random.Random(1))
    waits = [
        Attempts(policy, RetryBudget(0.0, 100.0), clock, random.Random(seed)).wait_s(Yielded("r", 500, "inflight"))
        for seed in range(50)
    ]
    assert all(w is not None and 0.5 <= w <= 0.6 for w in waits)  # never sooner than told
    assert len(set(waits)) > 1
    # an appointment (a ticket) is kept at its time: no jitter, which could only make it late
    booked = Attempts(policy, RetryBudget(0.0, 100.0), clock, random.Random(1))
    assert booked.wait_s(Yielded("r", 500, "inflight", "t1")) == 0.5
    wait = attempts.wait_s(Yielded("r", 500, "inflight"))
    assert wait is not None
    assert attempts.wait_s(WorkerUnavailable("starting")) is not None  # backoff, no hint needed
    assert attempts.wait_s(Yielded("r", 1, "inflight")) is None  # 3 attempts made
    fresh = Attempts(policy, RetryBudget(0.0, 100.0), clock, random.Random(1))
    assert fresh.wait_s(Yielded("r", 20_000, "qps")) is None  # past the deadline
    assert fresh.wait_s(WorkerLost("gone")) is None  # may have run: never repeated
    assert fresh.wait_s(IntegrityMismatch("bad")) is None  # the request is at fault


@given(st.lists(st.booleans(), max_size=400), st.floats(0, 1), st.floats(0, 20))
def test_retries_never_exceed_the_budget(pattern: list[bool], ratio: float, reserve: float) -> None:
    """Each element is one request: True if it is yielded (and wants a retry). However the
    yields fall, retries <= reserve + ratio * first attempts."""
    budget = RetryBudget(ratio, reserve)
    clock = Clock()
    policy = RetryPolicy(max_attempts=1_000, deadline_s=1e9, budget_ratio=ratio, budget_reserve=reserve)
    firsts = retries = 0
    for yielded in pattern:
        attempts = Attempts(policy, budget, clock, random.Random(0))
        firsts += 1
        while yielded and attempts.wait_s(Yielded("r", 1, "inflight")) is not None:
            retries += 1
            yielded = retries % 3 != 0  # some retries are admitted, some yielded again
    assert retries <= reserve + ratio * firsts + 1e-9


def test_a_client_told_no_address_reads_governor_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from governor.client.where import client_address

    monkeypatch.delenv("GOVERNOR_ADDRESS", raising=False)
    assert str(client_address(None, None, None)) == "127.0.0.1:7070"
    monkeypatch.setenv("GOVERNOR_ADDRESS", "10.0.0.5:9000")
    assert str(client_address(None, None, None)) == "10.0.0.5:9000"
    assert str(client_address(None, 7171, None)) == "127.0.0.1:7171"  # what it is told wins
    assert str(client_address("::1", None, "unix:/tmp/w.sock")) == "unix:/tmp/w.sock"
