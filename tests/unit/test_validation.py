from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson
import pytest

from govwire.codec import decode, encode_error, encode_yield, generate_frame
from govwire.errors import ERRORS_BY_CODE, BadFrame, BadJson, IntegrityMismatch, UnknownOp, error_from_code
from govwire.request import GenerateRequest, IntegrityMode, Limits, frame_op, validate_generate, verify_integrity
from govwire.vocab import ErrorCode

LIMITS = Limits(max_new_tokens=64)


def validate_frame(obj: Any, limits: Limits) -> str:
    """Envelope then fields, as the ingress runs them for an admitted frame."""
    op = frame_op(obj)
    if op == "generate":
        validate_generate(obj, limits)
    return op


def good(**overrides: Any) -> dict[str, Any]:
    frame = generate_frame("r1", "héllo", max_new_tokens=4)
    frame.update(overrides)
    return frame


def test_generate_frame_carries_size_and_digest_of_utf8_bytes() -> None:
    frame = good()
    assert frame["size"] == len("héllo".encode()) == 6
    assert frame["sha256"] == hashlib.sha256("héllo".encode()).hexdigest()
    assert validate_frame(frame, LIMITS) == "generate"
    verify_integrity(frame, LIMITS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt", 5),
        ("prompt", None),
        ("max_new_tokens", 0),
        ("max_new_tokens", 65),
        ("max_new_tokens", True),
        ("max_new_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", "1"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 1.5),
        ("seed", -1),
        ("seed", 2**64),
        ("stop_on_eos", 1),
        ("stream", "yes"),
        ("size", -1),
        ("size", "6"),
        ("sha256", "ABC"),
        ("sha256", "A" * 64),
        ("op", 7),
    ],
)
def test_bad_field_is_bad_frame_naming_the_field_and_keeping_the_id(field: str, value: Any) -> None:
    with pytest.raises(BadFrame) as info:
        validate_frame(good(**{field: value}), LIMITS)
    assert info.value.request_id == "r1"
    assert field.split("_")[0] in info.value.message


@pytest.mark.parametrize("rid", [None, 5, "", "x" * 257, ["a"]])
def test_unusable_id_is_bad_frame_with_null_id(rid: Any) -> None:
    with pytest.raises(BadFrame) as info:
        validate_frame(good(id=rid), LIMITS)
    assert info.value.request_id is None


def test_non_object_frames_and_bad_json() -> None:
    for value in ([1], "x", 3, None):
        with pytest.raises(BadFrame):
            validate_frame(value, LIMITS)
    for raw in (b"{", b"nope", b'{"a":NaN}', b'{"a":"\\ud800"}', b"\xff\xfe"):
        with pytest.raises(BadJson):
            decode(raw)


def test_null_fields_mean_absent() -> None:
    frame = good(**dict.fromkeys(["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_on_eos", "stream"]))
    assert validate_frame(frame, LIMITS) == "generate"
    request = GenerateRequest.from_frame(frame, LIMITS)
    assert request == GenerateRequest(id="r1", prompt="héllo")


@pytest.mark.parametrize("op", [[1], {"a": 1}, 3, True])
def test_non_string_op_is_bad_frame(op: Any) -> None:
    with pytest.raises(BadFrame, match="op"):
        frame_op({"id": "a", "op": op})


def test_unknown_op_and_control_ops() -> None:
    with pytest.raises(UnknownOp) as info:
        validate_frame({"id": "a", "op": "explode"}, LIMITS)
    assert info.value.request_id == "a"
    assert validate_frame({"id": "a", "op": "ping"}, LIMITS) == "ping"
    assert validate_frame({"id": "a", "op": "stats"}, LIMITS) == "stats"


def test_integrity_modes() -> None:
    bare = {"id": "a", "prompt": "x"}
    with pytest.raises(BadFrame, match="required"):
        validate_frame(bare, LIMITS)
    optional = Limits(integrity=IntegrityMode.OPTIONAL)
    assert validate_frame(bare, optional) == "generate"
    verify_integrity(bare, optional)
    with pytest.raises(IntegrityMismatch, match="size"):
        verify_integrity(good(size=7), optional)
    with pytest.raises(IntegrityMismatch, match="sha256"):
        verify_integrity(good(sha256="0" * 64), LIMITS)
    off = Limits(integrity=IntegrityMode.OFF)
    verify_integrity(good(sha256="0" * 64, size=99), off)


def test_generate_request_defaults_and_round_trip() -> None:
    request = GenerateRequest.from_frame({"id": "a", "prompt": "p"}, LIMITS)
    assert (request.max_new_tokens, request.temperature, request.stream, request.stop_on_eos) == (16, 1.0, True, True)
    again = GenerateRequest.from_frame(request.to_frame(), LIMITS)
    assert again == request
    # The default never exceeds a lower server limit.
    assert GenerateRequest.from_frame({"id": "a", "prompt": "p"}, Limits(max_new_tokens=8)).max_new_tokens == 8


def test_reply_bytes_are_pinned() -> None:
    assert (
        encode_yield("r1", 25, "inflight") == b'{"id":"r1","status":"yield","retry_hint_ms":25,"reason":"inflight"}\n'
    )
    assert encode_error(BadJson("invalid JSON: x")) == (
        b'{"id":null,"status":"error","code":"bad_json","message":"invalid JSON: x"}\n'
    )


def test_error_codes_round_trip_through_the_wire() -> None:
    for code in ("bad_json", "bad_frame", "integrity", "worker_lost", "worker_unavailable", "duplicate_id"):
        reply = orjson.loads(encode_error(error_from_code(code, "m", "id1")))
        assert (reply["code"], reply["id"], reply["status"]) == (code, "id1", "error")
    assert error_from_code("no_such_code", "m").code == "internal"


def test_every_error_code_has_its_error_class_and_comes_back_typed() -> None:
    """A code missing from the registry would be counted under an enum key and read back as `internal`."""
    assert set(ERRORS_BY_CODE) == {code.value for code in ErrorCode}
    for code, cls in ERRORS_BY_CODE.items():
        assert type(error_from_code(code, "m")) is cls and cls.code == code


def test_a_chats_messages_are_checked_normalised_and_forwarded() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    frame = good(messages=messages)
    validate_frame(frame, LIMITS)
    request = GenerateRequest.from_frame(frame, LIMITS)
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert request.to_frame()["messages"] == request.messages
    assert "messages" not in GenerateRequest.from_frame(good(), LIMITS).to_frame()


@pytest.mark.parametrize(
    ("messages", "names"),
    [
        ([], "messages must be a list"),
        ("hi", "messages must be a list"),
        ([{"role": "robot", "content": "x"}], "messages[0] must be"),
        ([{"role": "user", "content": "x", "extra": 1}], "messages[0] must be"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], "messages[1].content must be text"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content must be text"),
    ],
)
def test_bad_messages_are_a_bad_frame_naming_the_field(messages: Any, names: str) -> None:
    with pytest.raises(BadFrame, match=re.escape(names)):
        validate_frame(good(messages=messages), LIMITS)
