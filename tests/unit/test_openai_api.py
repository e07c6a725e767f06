"""The OpenAI completions mapping, both ways (openai_api.py)."""

from __future__ import annotations

import email.utils
import time

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.openai_api import (
    MAX_RETRY_AFTER_S,
    UpstreamProtocolError,
    chat_frame_of,
    chunk_event,
    completion_body,
    completion_response,
    generate_frame_of,
    read_chunk,
    retry_after_s,
)
from govwire.errors import BadFrame
from govwire.messages import Completion
from govwire.request import GenerateRequest, IntegrityMode, Limits, checked_request
from govwire.vocab import FinishReason


def test_an_admitted_request_becomes_a_streaming_body_with_usage() -> None:
    path, body = completion_body(GenerateRequest("r", "hi", max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3), "m")
    assert path == "/completions" and body == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_chat_request_goes_to_chat_completions_with_its_messages() -> None:
    frame, messages = chat_frame_of(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
            "max_completion_tokens": 5,
            "stream": True,
        },
        "c",
    )
    assert frame["prompt"] == "Be brief.\nHi" and frame["max_new_tokens"] == 5  # what the cost is estimated from
    request = checked_request(frame, Limits(64, IntegrityMode.OFF))
    request.messages = messages
    path, body = completion_body(request, "m")
    assert path == "/chat/completions" and body["messages"][1] == {"role": "user", "content": "Hi"}
    assert "prompt" not in body and body["max_tokens"] == 5
    assert read_chunk('{"choices":[{"index":0,"delta":{"content":"yo"}}]}').text == "yo"
    assert read_chunk('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}').text == ""


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        {"messages": [{"role": "user", "content": "x"}], "n": 2},
    ],
)
def test_chat_requests_beyond_text_messages_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(BadFrame):
        chat_frame_of(body, "c")


@pytest.mark.parametrize(("field", "value"), [("top_k", 5), ("stop_on_eos", False)])
def test_fields_without_an_openai_meaning_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(BadFrame, match=field):
        completion_body(GenerateRequest("r", "hi", **{field: value}), "m")  # type: ignore[arg-type]


def test_chunks_are_read_with_their_text_finish_and_usage() -> None:
    assert read_chunk('{"choices":[{"index":0,"text":"ab"}]}').text == "ab"
    last = read_chunk(
        '{"choices":[{"text":"","finish_reason":"length"}],'
        '"usage":{"prompt_tokens":4,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":2}}}'
    )
    assert last.finish_reason is FinishReason.LENGTH and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (4, 8, 2)
    assert read_chunk('{"choices":[{"text":"","finish_reason":"stop"}]}').finish_reason is FinishReason.EOS
    assert read_chunk('{"choices":[],"usage":null}').usage is None


@pytest.mark.parametrize(
    "data",
    ["nope", "[1]", '{"error":"index out of range"}', '{"choices":[{"text":3}]}', '{"usage":{"prompt_tokens":-1}}'],
)
def test_what_is_not_a_chunk_is_an_upstream_protocol_error(data: str) -> None:
    with pytest.raises(UpstreamProtocolError):
        read_chunk(data)


def test_retry_after_prefers_milliseconds_then_seconds_then_a_date() -> None:
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "3"}) == 0.25
    assert retry_after_s({"retry-after": "3"}) == 3.0
    date = email.utils.formatdate(time.time() + 10, usegmt=True)
    wait = retry_after_s({"retry-after": date})
    assert wait is not None and 8 < wait <= 10
    assert retry_after_s({"retry-after": "9999"}) == MAX_RETRY_AFTER_S
    assert retry_after_s({"retry-after-ms": "nan", "retry-after": "junk"}) is None
    assert retry_after_s({}) is None


def test_a_client_body_becomes_the_generate_frame_the_ndjson_port_reads() -> None:
    body = {
        "model": "gpt2",
        "prompt": ["hello"],
        "max_tokens": 5,
        "temperature": 0,
        "n": 1,
        "stop": None,
        "stream": True,
        "ignore_eos": True,
        "priority": "critical",
    }
    frame = generate_frame_of(body, "cmpl-1")
    request = checked_request(frame, Limits(64, IntegrityMode.OFF))
    assert (request.prompt, request.max_new_tokens, request.temperature, request.stream) == ("hello", 5, 0.0, True)
    assert request.stop_on_eos is False and frame["priority"] == "critical"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": "x", "n": 2}, "n=2"),
        ({"prompt": "x", "stop": ["\n"]}, "stop"),
        ({"prompt": "x", "logprobs": 5}, "logprobs"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"prompt": ["a", "b"]}, "one prompt"),
        ({"prompt": [1, 2, 3]}, "one prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
    ],
)
def test_what_one_generate_frame_cannot_express_is_refused_by_name(body: dict[str, object], named: str) -> None:
    with pytest.raises(BadFrame, match=named):
        generate_frame_of(body, "r")


@given(st.text(max_size=50), st.sampled_from(list(FinishReason)))
def test_responses_and_chunks_are_json_the_sdk_can_read(text: str, finish: FinishReason) -> None:
    completion = Completion(text, 3, 4, finish, 0.0)
    whole = orjson.loads(completion_response("id", "m", 1, completion))
    assert whole["choices"][0]["text"] == text and whole["usage"]["total_tokens"] == 7
    event = chunk_event("id", "m", 1, text, finish)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:])["choices"][0]["text"] == text
