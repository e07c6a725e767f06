"""Server-sent events, decoded from bytes as they arrive: no I/O, no text decoding.

The OpenAI-compatible link (openai_link.py) reads a streamed completion's body through this: each
read's bytes go in, the `data` of each complete event comes out, still bytes (the HTTP front door
relays it as it came; orjson parses bytes directly). It follows the WHATWG event-stream rules for
what a streamed completion uses: lines end with CRLF, LF or CR; a blank line ends an event; the
`data` lines of an event are joined by LF, one space after the colon dropped; an event without
data is not dispatched; comments (`:`), `event`, `id` and `retry` are skipped (OpenAI-compatible
servers send only unnamed events).
"""

from __future__ import annotations

MAX_EVENT_BYTES = 1 << 20  # a line or an event beyond this is not a completion chunk: refused


class SseError(ValueError):
    """The stream broke the framing bounds (an endless line or event)."""


class SseDecoder:
    """One response body's events. `feed` returns the data of the events it completed."""

    __slots__ = ("_after_cr", "_data", "_data_bytes", "_tail")

    def __init__(self) -> None:
        self._tail = b""  # an unfinished line
        self._data: list[bytes] = []  # the data lines of the event being read
        self._data_bytes = 0
        self._after_cr = False  # the last read ended with CR: an LF that begins the next is its pair

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buffer = self._tail + chunk if self._tail else chunk
        if b"\r" in buffer:
            # CRLF and lone CR end lines too; a CR that ends the read ends its line now.
            self._after_cr = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            lines = buffer.split(b"\n")
            self._tail = lines.pop()
        else:
            lines = buffer.split(b"\n")
            self._tail = lines.pop()
        if len(self._tail) > MAX_EVENT_BYTES:
            raise SseError(f"an event-stream line exceeds {MAX_EVENT_BYTES} bytes")
        events: list[bytes] = []
        data = self._data
        for line in lines:
            if not line:  # the end of an event
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
                    self._data_bytes = 0
                continue
            if line[:5] == b"data:":
                value = line[6:] if line[5:6] == b" " else line[5:]
            elif line == b"data":
                value = b""
            else:
                continue  # a comment or another field
            data.append(value)
            self._data_bytes += len(value) + 1
            if self._data_bytes > MAX_EVENT_BYTES:
                raise SseError(f"an event's data exceeds {MAX_EVENT_BYTES} bytes")
        return events
