"""A streamed completion as the OpenAI link speaks it (links/openai_stream.py): request bodies,
chunks read back, Retry-After."""

from __future__ import annotations

import email.utils
import time

import pytest

from governor.admission.endpoint import OpenAITarget
from governor.doors.openai_api import chat_frame_of
from governor.links.openai_stream import (
    MAX_RETRY_AFTER_S,
    UpstreamProtocolError,
    completion_body,
    read_chunk,
    retry_after_s,
)
from govwire.errors import BadFrame
from govwire.request import GenerateRequest, IntegrityMode, Limits, checked_request
from govwire.vocab import FinishReason

TARGET = OpenAITarget("http://127.0.0.1:8000/v1", "m")


def test_an_admitted_request_becomes_a_streaming_body_with_usage() -> None:
    request = GenerateRequest("r", "hi", max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3)
    path, body = completion_body(request, TARGET)
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
    path, body = completion_body(request, TARGET)
    assert path == "/chat/completions" and body["messages"][1] == {"role": "user", "content": "Hi"}
    assert "prompt" not in body and body["max_tokens"] == 5
    assert read_chunk('{"choices":[{"index":0,"delta":{"content":"yo"}}]}').text == "yo"
    assert read_chunk('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}').text == ""


def test_top_k_has_no_openai_meaning_and_is_refused_by_name() -> None:
    with pytest.raises(BadFrame, match="top_k"):
        completion_body(GenerateRequest("r", "hi", top_k=5), TARGET)


def test_ignore_eos_is_passed_on_unless_the_endpoint_refuses_it() -> None:
    request = GenerateRequest("r", "hi", stop_on_eos=False)
    assert completion_body(request, TARGET)[1]["ignore_eos"] is True
    assert "ignore_eos" not in completion_body(GenerateRequest("r", "hi"), TARGET)[1]
    with pytest.raises(BadFrame, match="ignore_eos"):
        completion_body(request, OpenAITarget("http://127.0.0.1:8000/v1", "m", ignore_eos="refuse"))


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
