"""Shared-secret authentication, the same on both hops (client -> governor, governor -> worker).

The first frame on a connection must be `{"op": "auth", "token": ...}`. The token is compared in
constant time and never logged; its file is read once at start.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson

from govwire.errors import Unauthorized
from govwire.framing import TOO_LARGE, Item
from govwire.request import MAX_ID_CHARS
from govwire.vocab import Op

MAX_TOKEN_BYTES = 4096
AUTH_FRAME_BYTES = 6 * MAX_TOKEN_BYTES + 1024  # the longest line read before authentication (\uXXXX escapes)


@dataclass(frozen=True)
class SharedSecret:
    token: bytes = field(repr=False)  # repr=False: a logged config never shows it

    def matches(self, candidate: object) -> bool:
        if type(candidate) is not str or len(candidate) > MAX_TOKEN_BYTES:
            return False
        return hmac.compare_digest(candidate.encode(), self.token)

    def frame(self) -> dict[str, str]:
        """The frame that opens a connection to a peer expecting this secret."""
        return {"op": Op.AUTH, "token": self.token.decode()}

    @classmethod
    def generate(cls) -> SharedSecret:
        """A per-run secret for the workers the governor spawns."""
        return cls(secrets.token_urlsafe(32).encode())

    @classmethod
    def from_text(cls, text: str, source: str) -> SharedSecret:
        token = text.strip()
        if not token:
            raise ValueError(f"{source}: the token is empty")
        if len(token.encode()) > MAX_TOKEN_BYTES or not token.isprintable():
            raise ValueError(f"{source}: the token must be printable and at most {MAX_TOKEN_BYTES} bytes")
        return cls(token.encode())

    @classmethod
    def read(cls, path: str) -> SharedSecret:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_TOKEN_BYTES + 2)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the token: {exc}") from None
        return cls.from_text(text, path)


def auth_candidate(line: Item) -> Any:
    """A line offered as the first frame, parsed for `authenticate`: an oversized or unreadable
    line becomes None, which is as unauthorized as a wrong token."""
    if line is TOO_LARGE:
        return None
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


def authenticate(frame: Any, secret: SharedSecret | None) -> str | None:
    """The id of a valid `auth` frame (None when it has none), or `Unauthorized`. With no secret
    configured any `auth` frame passes, so a client set up with a token still talks to a governor
    without one."""
    if type(frame) is not dict or frame.get("op") != Op.AUTH:
        raise Unauthorized('a connection must open with {"op": "auth", "token": ...}')
    if secret is not None and not secret.matches(frame.get("token")):
        raise Unauthorized('a connection must open with {"op": "auth", "token": ...} carrying the right token')
    rid = frame.get("id")
    return rid if type(rid) is str and 0 < len(rid) <= MAX_ID_CHARS else None
