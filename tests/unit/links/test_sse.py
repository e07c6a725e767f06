"""The event-stream decoder: the events of any stream, however its bytes are split across reads,
are those a reference decoder (httpx-sse, which the link used before) reads from the whole."""

from __future__ import annotations

import httpx
import pytest
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.links.sse import MAX_EVENT_BYTES, SseDecoder, SseError

LINE_ENDS = st.sampled_from([b"\n", b"\r\n", b"\r"])
TEXT = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20)


def reference(stream: bytes) -> list[bytes]:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)
    return [event.data.encode() for event in EventSource(response).iter_sse() if event.data]


def decoded(stream: bytes, cuts: list[int]) -> list[bytes]:
    decoder, events, start = SseDecoder(), [], 0
    for cut in [*sorted(cuts), len(stream)]:
        events += decoder.feed(stream[start:cut])
        start = cut
    return events


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """Events of data lines (and comments, other fields, a space or none after the colon), each
    line ended by any of the three line ends, events separated by a blank line."""
    out = b""
    for _ in range(draw(st.integers(0, 6))):
        for _ in range(draw(st.integers(1, 3))):
            field = draw(st.sampled_from([b"data", b"data", b"event", b"id", b"", b"retry"]))
            value = draw(TEXT).encode()
            if field == b"data" and not value and draw(st.booleans()):
                line = b"data"  # a bare field name: an empty data line
            else:
                line = field + b":" + draw(st.sampled_from([b" ", b""])) + value
            out += line + draw(LINE_ENDS)
        out += draw(LINE_ENDS)
    return out


@settings(max_examples=300, deadline=None)
@given(streams(), st.data())
def test_any_split_of_a_stream_decodes_as_the_reference_decodes_the_whole(stream: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    events = decoded(stream, cuts)
    # httpx-sse keeps an event whose data is empty apart ("" data lines only): the link skips those.
    assert [e for e in events if e] == reference(stream)


def test_a_completion_stream_with_crlf_in_one_byte_reads() -> None:
    stream = b'data: {"choices":[]}\r\n\r\n: ping\r\ndata: [DONE]\r\n\r\n'
    assert decoded(stream, list(range(len(stream)))) == [b'{"choices":[]}', b"[DONE]"]


def test_multi_line_data_is_joined_by_newlines() -> None:
    assert SseDecoder().feed(b"data: a\ndata:b\ndata\n\n") == [b"a\nb\n"]


def test_an_endless_line_or_event_is_refused() -> None:
    decoder = SseDecoder()
    with pytest.raises(SseError):
        for _ in range(MAX_EVENT_BYTES // 65536 + 2):
            decoder.feed(b"data: " + b"a" * 65536)
    decoder = SseDecoder()
    with pytest.raises(SseError):
        for _ in range(MAX_EVENT_BYTES // 65536 + 2):
            decoder.feed(b"data: " + b"a" * 65530 + b"\n")
