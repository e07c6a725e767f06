"""Hostile and malformed input against the sans-IO ingress (issue 6).

Whatever bytes arrive, in whatever chunks: the ingress never raises, every complete line gets
exactly one answer (an immediate reply, or a dispatch that the worker side settles later), every
reply is well-formed protocol, no slot outlives the connection and the counters balance.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.doors.ndjson import Ingress
from govwire.codec import encode, generate_frame
from govwire.errors import ERRORS_BY_CODE
from govwire.request import MAX_ID_CHARS, MAX_SEED, IntegrityMode
from govwire.vocab import YieldReason
from tests.fakes import FakeTransportWrites, FakeUpstream, done_frame, make_ingress, make_state

MAX_FRAME = 512
MAX_NEW_TOKENS = 64
KNOWN_STATUSES = {"accepted", "token", "done", "error", "yield", "pong", "stats"}
_BLANK = (b"", b"\r")


def expected_id(line: bytes, max_frame: int) -> str | None:
    """The id a line's answer must carry: null unless the frame could be read up to a usable id."""
    if len(line) > max_frame:
        return None
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    rid = obj.get("id") if type(obj) is dict else None
    return rid if type(rid) is str and 0 < len(rid) <= MAX_ID_CHARS else None


def check_reply(reply: dict[str, Any]) -> None:
    assert reply["status"] in KNOWN_STATUSES, reply
    assert reply["id"] is None or type(reply["id"]) is str, reply
    if reply["status"] == "error":
        assert reply["code"] in ERRORS_BY_CODE and type(reply["message"]) is str, reply
    if reply["status"] == "yield":
        assert reply["reason"] in set(YieldReason) and type(reply["retry_hint_ms"]) is int, reply
        assert reply["retry_hint_ms"] > 0


def parsed(writes: FakeTransportWrites) -> list[dict[str, Any]]:
    replies = [orjson.loads(line) for line in writes.lines()]  # raises on a malformed reply
    for reply in replies:
        check_reply(reply)
    return replies


def feed(ingress: Ingress, stream: bytes, cuts: list[int]) -> None:
    bounds = sorted({0, len(stream), *cuts})
    for a, b in zip(bounds, bounds[1:], strict=False):
        ingress.receive_data(stream[a:b])


def valid_line(rid: str, prompt: str = "hi", **fields: Any) -> bytes:
    return encode(generate_frame(rid, prompt, **fields))


# -- hostile building blocks ----------------------------------------------------------------------

HOSTILE_LINES = [
    b"[" * 100_000,  # nesting far past any parser's depth limit
    b'{"a":' * 20_000,
    b'{"id":"n","prompt":"x","max_new_tokens":1e400}',  # infinity when parsed as a double
    b'{"id":"n","prompt":"x","temperature":-1e400}',
    b'{"id":"n","prompt":"x","seed":' + str(2**200).encode() + b"}",
    b'{"id":"n","prompt":"x","max_new_tokens":' + str(2**200).encode() + b"}",
    b'{"id":"\xff\xfe"}',  # invalid UTF-8
    b'{"id":"\xed\xa0\x80"}',  # an encoded surrogate
    b'{"id":"\\ud800","prompt":"x"}',  # a lone escaped surrogate
    b'{"id":"a\x00b"}',
    b"\x00" * 64,
    b'{"id":"' + b"i" * (MAX_ID_CHARS + 1) + b'","prompt":"x"}',
    b'{"id":"' + b"i" * MAX_ID_CHARS + b'","op":"ping"}',
    b'{"id":"z","op":["generate"]}',
    b'{"id":"z","op":{"a":1}}',
    b'{"id":"z","op":"' + b"o" * 10_000 + b'"}',
    b'{"id":""}',
    b'{"id":null,"op":"stats"}',
    b'{"id":"s","op":"stats"}\r',
    b'{"id":"p","op":"ping"}\r\r',
    b"\r\r",
    b" ",
    b"NaN",
    b"[]",
    b'"just a string"',
    b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark
]

# JSON values of every type (ints as wide as orjson writes); numbers beyond that are spelled out below.
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_raw_numbers = st.sampled_from(
    [b"1e400", b"-1e400", b"1e-400", str(2**200).encode(), str(2**64).encode(), str(2**64 - 1).encode(), b"-0"]
    + [b"0", b"1", b"-1", str(MAX_NEW_TOKENS).encode(), str(MAX_NEW_TOKENS + 1).encode(), b"1.0", b"0.5", b"1e2"]
)


# Values that are valid for some fields keep admitted frames in the mix, not only rejections.
_plausible = st.sampled_from([b"null", b"true", b"false", b"2", b"0.25", b'"x"', b'"' + b"p" * 300 + b'"'])
_field_values = st.one_of(_json_values.map(orjson.dumps), _raw_numbers, _plausible)

GENERATE_FIELDS = (
    "id",
    "prompt",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_on_eos",
    "stream",
    "ack",
    "size",
    "sha256",
)


def _is_int(v: object) -> bool:
    return type(v) is int


def _is_number(v: object) -> bool:
    return type(v) in (int, float)


# The documented field table (docs/protocol.md, "Request frame"), as predicates on decoded values.
FIELD_OK: dict[str, Callable[[Any], bool]] = {
    "prompt": lambda v: type(v) is str,
    "max_new_tokens": lambda v: v is None or (_is_int(v) and 1 <= v <= MAX_NEW_TOKENS),
    "temperature": lambda v: v is None or (_is_number(v) and v >= 0),
    "top_p": lambda v: v is None or (_is_number(v) and 0 < v <= 1),
    "top_k": lambda v: v is None or (_is_int(v) and v >= 0),
    "seed": lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_SEED),
    "stop_on_eos": lambda v: v is None or type(v) is bool,
    "stream": lambda v: v is None or type(v) is bool,
    "ack": lambda v: v is None or type(v) is bool,
    "prompt_tokens": lambda v: v is None or (_is_int(v) and 0 <= v <= 2**31 - 1),
    "deadline_ms": lambda v: v is None or (_is_number(v) and 0 < v <= 86_400_000),
    "size": lambda v: _is_int(v) and v >= 0,
    "sha256": lambda v: type(v) is str and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
}


def expected_outcome(line: bytes) -> tuple[str, str | None]:
    """What the documented order of checks says a single generate frame gets: (code or "admitted", id)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return "bad_json", None
    rid = obj.get("id")
    if type(rid) is not str or not 0 < len(rid) <= MAX_ID_CHARS:
        return "bad_frame", None
    for name, ok in FIELD_OK.items():
        if not ok(obj.get(name)):
            return "bad_frame", rid
    data = obj["prompt"].encode()
    if obj["size"] != len(data) or obj["sha256"] != hashlib.sha256(data).hexdigest():
        return "integrity", rid
    return "admitted", rid


@settings(max_examples=250)
@given(
    field=st.sampled_from(GENERATE_FIELDS),
    value=_field_values,
    prompt=st.text(max_size=30),
    ack=st.booleans(),
)
def test_any_value_in_any_generate_field_gets_the_documented_answer(
    field: str, value: bytes, prompt: str, ack: bool
) -> None:
    base = generate_frame("r", prompt, max_new_tokens=4, temperature=0.5, top_p=0.9, top_k=3, seed=1, ack=ack)
    # Replace the field's value in the encoded object, keeping every other field intact.
    line = orjson.dumps({k: v for k, v in base.items() if k != field})[:-1] + b',"' + field.encode() + b'":' + value
    line += b"}"
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, max_new_tokens=MAX_NEW_TOKENS, upstream=upstream)
    ingress, writes = make_ingress(state, max_frame_bytes=4096)
    ingress.receive_data(line + b"\n")
    outcome, rid = expected_outcome(line)
    replies = parsed(writes)
    if outcome == "admitted":
        ((request, generate),) = upstream.dispatched.values()
        assert request.client_id == rid and generate.prompt == orjson.loads(line)["prompt"]
        assert [r["status"] for r in replies] == (["accepted"] if generate.ack else [])
    else:
        assert [(r["status"], r["code"], r["id"]) for r in replies] == [("error", outcome, rid)]
        assert not upstream.dispatched
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0


@pytest.mark.parametrize("line", HOSTILE_LINES, ids=lambda b: repr(b[:24]))
def test_each_hostile_line_gets_one_well_formed_reply_and_holds_nothing(line: bytes) -> None:
    state = make_state(max_inflight=2, max_new_tokens=MAX_NEW_TOKENS)
    ingress, writes = make_ingress(state, max_frame_bytes=1 << 20)
    ingress.receive_data(line + b"\n")
    (reply,) = parsed(writes)
    assert reply["id"] == expected_id(line, 1 << 20)
    assert reply["status"] in ("error", "pong", "stats")
    assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0


def test_deep_nesting_fed_byte_by_byte_is_one_bad_json() -> None:
    state = make_state()
    ingress, writes = make_ingress(state, max_frame_bytes=1 << 20)
    for _ in range(100_000 // 8):
        ingress.receive_data(b"[" * 8)
    ingress.receive_data(b"\n")
    assert [(r["code"], r["id"]) for r in parsed(writes)] == [("bad_json", None)]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
@pytest.mark.parametrize("chunk", [1, 13, 10_000])
def test_frames_at_the_limit_are_served_and_one_byte_more_is_too_large(ending: bytes, chunk: int) -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, upstream=upstream)
    ingress, writes = make_ingress(state, max_frame_bytes=MAX_FRAME)
    body = valid_line("edge", "x" * 50).rstrip(b"\n")
    # The limit counts every byte before the newline, a trailing \r included.
    at_limit = body + b" " * (MAX_FRAME - len(body) - len(ending) + 1) + ending
    over = body.replace(b'"edge"', b'"over"') + b" " * (MAX_FRAME - len(body) - len(ending) + 2) + ending
    stream = at_limit + over + at_limit.replace(b'"edge"', b'"next"')
    assert len(at_limit) == MAX_FRAME + 1 and len(over) == MAX_FRAME + 2
    feed(ingress, stream, list(range(chunk, len(stream), chunk)))
    assert [request.client_id for request, _ in upstream.dispatched.values()] == ["edge", "next"]
    assert [(r["code"], r["id"]) for r in parsed(writes)] == [("frame_too_large", None)]
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0


def test_an_unterminated_over_size_line_is_answered_once_and_not_stored() -> None:
    state = make_state()
    ingress, writes = make_ingress(state, max_frame_bytes=MAX_FRAME)
    for _ in range(50):
        ingress.receive_data(b"\x00" * 100)
    assert [r["code"] for r in parsed(writes)] == ["frame_too_large"]
    assert ingress._splitter.buffered_bytes == 0  # the memory bound is the point
    ingress.receive_data(b'garbage\n{"id":"p","op":"ping"}\n')  # the rest of the huge line is skipped
    assert [r["status"] for r in parsed(writes)] == ["error", "pong"]


def test_duplicate_ids_are_refused_while_in_flight_and_reusable_after() -> None:
    upstream = FakeUpstream()
    state = make_state(max_inflight=4, upstream=upstream)
    ingress, writes = make_ingress(state)
    ingress.receive_data(valid_line("d") * 3)
    assert [(r["code"], r["id"]) for r in parsed(writes)] == [("duplicate_id", "d")] * 2
    assert state.admission.inflight.inflight == 1
    upstream.worker_sends(done_frame("1", "", "eos"))
    ingress.receive_data(valid_line("d"))
    assert list(ingress.active) == ["d"] and len(upstream.dispatched) == 2
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0 and state.accounting.unbalanced_by(0) == 0


# -- arbitrary streams ----------------------------------------------------------------------------


def _mutate(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, byte in flips:
        if out:
            out[pos % len(out)] = byte
    return bytes(out)


_valid = st.builds(
    lambda i, p, ack: valid_line(f"r{i}", p, max_new_tokens=2, ack=ack),
    st.integers(0, 4),
    st.text(max_size=12),
    st.booleans(),
)
_pieces = st.one_of(
    _valid,
    _valid.map(lambda b: b.replace(b"\n", b"\r\n")),
    st.builds(_mutate, _valid, st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=4)),
    st.builds(lambda b, n: b[:n], _valid, st.integers(0, 80)),  # truncated, then spliced onto what follows
    st.binary(max_size=80),
    st.sampled_from([line + b"\n" for line in HOSTILE_LINES if len(line) <= MAX_FRAME]),
    st.sampled_from([b"\n", b"\r\n", b"\x00\n", b'{"id":"p","op":"ping"}\n', b'{"id":"s","op":"stats"}\n']),
    st.integers(MAX_FRAME - 2, MAX_FRAME + 2).map(lambda n: b"y" * n + b"\n"),
)


@settings(max_examples=200)
@given(
    pieces=st.lists(_pieces, max_size=10),
    cuts=st.lists(st.integers(0, 4000), max_size=10),
    endings=st.lists(st.sampled_from(["done", "error", "lost", "open"]), max_size=12),
    max_inflight=st.integers(1, 4),
)
def test_any_stream_in_any_chunking_gets_one_answer_per_line_and_leaks_nothing(
    pieces: list[bytes], cuts: list[int], endings: list[str], max_inflight: int
) -> None:
    upstream = FakeUpstream()
    state = make_state(
        max_inflight=max_inflight, max_new_tokens=MAX_NEW_TOKENS, upstream=upstream, integrity=IntegrityMode.OPTIONAL
    )
    ingress, writes = make_ingress(state, max_frame_bytes=MAX_FRAME)
    stream = b"".join(pieces)
    feed(ingress, stream, [c for c in cuts if c < len(stream)])

    *complete, tail = stream.split(b"\n")
    lines = [line for line in complete if line not in _BLANK] + ([tail] if len(tail) > MAX_FRAME else [])
    immediate = [r for r in parsed(writes) if r["status"] != "accepted"]
    dispatched = [request.client_id for request, _ in upstream.dispatched.values()]
    # One answer per line, carrying the id the line's frame named (null when it had no usable one).
    assert Counter([r["id"] for r in immediate] + dispatched) == Counter(expected_id(li, MAX_FRAME) for li in lines)
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0
    assert state.admission.inflight.inflight == len(ingress.active) <= max_inflight

    # The worker side settles some requests; the client then goes away with the rest in flight.
    requests = [request for request, _ in upstream.dispatched.values()]
    before = len(writes.lines())
    settled = 0
    for request, how in zip(requests, endings, strict=False):
        frame = done_frame(request.uid, "", "eos")
        if how == "error":
            frame = {"id": request.uid, "status": "error", "code": "bad_frame", "message": "too long"}
        if how == "lost":
            state.admission.pool.endpoints[0].up = False  # no endpoint to re-route to: the loss is final
            state.lifecycle.lose(request, "gone")
        elif how != "open":
            upstream.worker_sends(frame)
        settled += how != "open"
    ingress.flush()
    finals = [r for r in parsed(writes)[before:] if r["status"] in ("done", "error")]
    assert len(finals) == settled
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0 and not ingress.active
    assert state.accounting.unbalanced_by(0) == 0
    assert state.accounting.failed["client_disconnected"] == len(requests) - settled


@settings(max_examples=150)
@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=20))
def test_random_bytes_never_raise_and_answer_every_line(data: bytes, cuts: list[int]) -> None:
    upstream = FakeUpstream()
    upstream.available = False  # an admitted frame is answered at once too, so every line is
    state = make_state(max_inflight=2, upstream=upstream)
    ingress, writes = make_ingress(state, max_frame_bytes=64)
    stream = data + b"\n"
    feed(ingress, stream, [c for c in cuts if c < len(stream)])
    lines = [line for line in stream.split(b"\n")[:-1] if line not in _BLANK]
    replies = parsed(writes)
    assert [r["id"] for r in replies] == [expected_id(line, 64) for line in lines]
    assert state.accounting.received == sum(r["status"] not in ("pong", "stats") for r in replies)
    assert state.accounting.unbalanced_by(state.admission.inflight.inflight) == 0
    ingress.connection_lost()
    assert state.admission.inflight.inflight == 0
