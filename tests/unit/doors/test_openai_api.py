"""The OpenAI-compatible API the front door serves (doors/openai_api.py): client bodies become
frames, replies become OpenAI shapes."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.doors.openai_api import chat_frame_of, chunk_event, completion_response, generate_frame_of
from govwire.errors import BadFrame
from govwire.messages import Completion
from govwire.request import IntegrityMode, Limits, checked_request
from govwire.vocab import FinishReason


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "user", "content": "x"}], "n": 2},
    ],
)
def test_chat_requests_beyond_text_messages_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(BadFrame):
        chat_frame_of(body, "c")


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
