from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from govwire.framing import TOO_LARGE, LineSplitter

CASES = [
    (b'{"a":1}\n', [b'{"a":1}']),
    (b"a\nb\nc\n", [b"a", b"b", b"c"]),
    (b"a\r\n", [b"a\r"]),
    (b"\n\n", [b"", b""]),
    (b"x" * 8 + b"\n", [b"x" * 8]),
    (b"x" * 9 + b"\nok\n", [TOO_LARGE, b"ok"]),
]


def feed_all(splitter: LineSplitter, chunks: list[bytes]) -> list[object]:
    out: list[object] = []
    for chunk in chunks:
        out.extend(splitter.feed(chunk))
    return out


@pytest.mark.parametrize(("data", "expected"), CASES)
def test_whole_byte_by_byte_and_with_trailing_bytes(data: bytes, expected: list[object]) -> None:
    assert feed_all(LineSplitter(8), [data]) == expected
    assert feed_all(LineSplitter(8), [data[i : i + 1] for i in range(len(data))]) == expected
    splitter = LineSplitter(8)
    assert feed_all(splitter, [data + b"tail"]) == expected
    assert splitter.buffered_bytes == 4  # the incomplete frame waits for its newline


def test_oversized_partial_is_reported_once_and_skipped_without_buffering() -> None:
    splitter = LineSplitter(8)
    assert splitter.feed(b"x" * 5) == []
    assert splitter.feed(b"x" * 5) == [TOO_LARGE]
    assert splitter.buffered_bytes == 0 and splitter.is_skipping
    assert splitter.feed(b"y" * 10_000) == []  # still the same oversized line: dropped, not stored
    assert splitter.buffered_bytes == 0
    assert splitter.feed(b"zz\nnext\n") == [b"next"]
    assert not splitter.is_skipping


def test_frame_exactly_at_the_limit_is_accepted_across_chunks() -> None:
    splitter = LineSplitter(8)
    assert splitter.feed(b"1234") == []
    assert splitter.feed(b"5678\n") == [b"12345678"]
    assert splitter.feed(b"1234") == []
    assert splitter.feed(b"56789\n") == [TOO_LARGE]


@given(st.lists(st.binary(max_size=40), max_size=30), st.data())
def test_any_split_of_a_stream_gives_the_same_items(chunks: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(chunks)
    reference = feed_all(LineSplitter(16), [stream])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    splitter = LineSplitter(16)
    assert feed_all(splitter, pieces) == reference
    assert splitter.buffered_bytes <= 16


@given(st.binary(max_size=400))
def test_items_match_a_naive_split(stream: bytes) -> None:
    *complete, _tail = stream.split(b"\n")
    expected = [TOO_LARGE if len(line) > 16 else line for line in complete]
    got = [item for item in feed_all(LineSplitter(16), [stream])]
    # An over-long unterminated tail is reported early; drop it for the comparison.
    if len(_tail) > 16:
        assert got[-1] is TOO_LARGE
        got = got[:-1]
    assert got == expected
