"""A small blocking client for protocol v1: one request at a time over one TCP connection."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator
from typing import Any

import orjson

from governor.framing import TOO_LARGE, LineSplitter
from governor.validation import OP_AUTH
from governor.wire import FINAL_STATUSES, STATUS_AUTHENTICATED, encode, generate_frame

MAX_REPLY_BYTES = 64 * 1024 * 1024


class Client:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 7070, timeout: float | None = 60.0, token: str | None = None
    ) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._splitter = LineSplitter(MAX_REPLY_BYTES)
        self._ready: list[bytes] = []
        self._ids = itertools.count(1)
        if token is not None:  # a governor started with --auth-token-file
            (reply,) = self.request({"id": "auth", "op": OP_AUTH, "token": token})
            if reply.get("status") != STATUS_AUTHENTICATED:
                self.close()
                raise PermissionError(f"the governor refused the token: {reply.get('message')}")

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, frame: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Send one frame; yield every reply carrying its id, ending with the final one."""
        self._sock.sendall(encode(frame))
        while True:
            reply = self._read_reply()
            if reply.get("id") not in (frame.get("id"), None):
                continue
            yield reply
            if reply.get("status") in FINAL_STATUSES or reply.get("status") in ("pong", "stats", STATUS_AUTHENTICATED):
                return

    def generate(self, prompt: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Stream a generate request (size and sha256 computed here)."""
        return self.request(generate_frame(f"c{next(self._ids)}", prompt, **fields))

    def _read_reply(self) -> dict[str, Any]:
        while not self._ready:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            for line in self._splitter.feed(data):
                if line is TOO_LARGE:
                    raise ConnectionError("reply larger than the client limit")
                self._ready.append(line)
        reply: dict[str, Any] = orjson.loads(self._ready.pop(0))
        return reply
