"""Incremental newline splitter with a hard frame-size cap.

Memory per connection is bounded by `max_frame_bytes`: a line that grows past the cap is reported
once as `TOO_LARGE` and the rest of it is skipped up to the next newline without being stored.
Each byte is searched for a newline once, so a client trickling a long line costs O(n), not O(n²).
"""

from __future__ import annotations

from enum import Enum
from typing import Final


class _Marker(Enum):
    TOO_LARGE = "TOO_LARGE"


TOO_LARGE: Final = _Marker.TOO_LARGE
"""Marker item in `feed()` output: one line exceeded the cap and was skipped."""

Item = bytes | _Marker


class LineSplitter:
    """Bytes in, complete lines out (without the trailing `\\n`)."""

    __slots__ = ("max_frame_bytes", "_partial", "_skipping")

    def __init__(self, max_frame_bytes: int) -> None:
        if max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be >= 1")
        self.max_frame_bytes = max_frame_bytes
        self._partial = bytearray()
        self._skipping = False

    @property
    def buffered_bytes(self) -> int:
        return len(self._partial)

    @property
    def is_skipping(self) -> bool:
        """True while the rest of an oversized line is being thrown away."""
        return self._skipping

    def feed(self, data: bytes) -> list[Item]:
        limit = self.max_frame_bytes
        out: list[Item] = []
        if self._skipping:
            nl = data.find(b"\n")
            if nl < 0:
                return out
            self._skipping = False
            data = data[nl + 1 :]
        if self._partial:
            nl = data.find(b"\n")
            if nl < 0:
                self._partial += data
                if len(self._partial) > limit:
                    self._partial.clear()
                    self._skipping = True
                    out.append(TOO_LARGE)
                return out
            if len(self._partial) + nl > limit:
                out.append(TOO_LARGE)
            else:
                self._partial += data[:nl]
                out.append(bytes(self._partial))
            self._partial.clear()
            data = data[nl + 1 :]
        lines = data.split(b"\n")
        tail = lines.pop()
        # Common case first: one C-level pass proves no line is over the cap.
        if lines and max(map(len, lines)) > limit:
            out.extend(TOO_LARGE if len(line) > limit else line for line in lines)
        else:
            out.extend(lines)
        if len(tail) > limit:
            self._skipping = True
            out.append(TOO_LARGE)
        elif tail:
            self._partial += tail
        return out
