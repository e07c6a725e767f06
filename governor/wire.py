"""NDJSON codec and reply encoders: the bytes of protocol v1 (see docs/protocol.md).

Shared by the governor, the worker and clients; imports only the stdlib and orjson.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from governor.errors import BadJson, GovernorError

PROTOCOL_VERSION = 1

STATUS_ACCEPTED = "accepted"
STATUS_TOKEN = "token"
STATUS_DONE = "done"
STATUS_ERROR = "error"
STATUS_YIELD = "yield"
STATUS_PONG = "pong"
STATUS_STATS = "stats"
STATUS_AUTHENTICATED = "authenticated"
FINAL_STATUSES = frozenset({STATUS_DONE, STATUS_ERROR, STATUS_YIELD})
# Reserved ids on the governor-worker link. Request ids the governor assigns are hex strings, so
# these never collide with a request's: the engine statistics the worker pushes, and the health ping.
WORKER_STATS_ID = "~stats"
WORKER_PING_ID = "~ping"
WORKER_AUTH_ID = "~auth"

_NL = orjson.OPT_APPEND_NEWLINE
_dumps = orjson.dumps


def bad_json(exc: orjson.JSONDecodeError) -> BadJson:
    return BadJson(f"invalid JSON: {exc}")


def decode(line: bytes) -> Any:
    """One frame's bytes to a Python value; any parse failure is `BadJson`."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise bad_json(exc) from None


def encode(obj: dict[str, Any]) -> bytes:
    """One frame, newline-terminated."""
    return _dumps(obj, option=_NL)


def encode_accepted(request_id: str) -> bytes:
    return _dumps({"id": request_id, "status": STATUS_ACCEPTED}, option=_NL)


def encode_yield(request_id: str, retry_hint_ms: int, reason: str) -> bytes:
    return _dumps(
        {"id": request_id, "status": STATUS_YIELD, "retry_hint_ms": retry_hint_ms, "reason": reason},
        option=_NL,
    )


def encode_error(error: GovernorError, request_id: str | None = None) -> bytes:
    rid = error.request_id if request_id is None else request_id
    return _dumps({"id": rid, "status": STATUS_ERROR, "code": error.code, "message": error.message}, option=_NL)


# A token frame as encode_token writes it: `{"id":"<id>","status":"token",...}`. The governor
# re-addresses these without parsing them (upstream.py), the one frame every generated token costs.
TOKEN_FRAME_HEAD = b'{"id":"'
TOKEN_FRAME_STATUS = b'","status":"token"'


def readdress_token(rest: bytes, request_id: str) -> bytes:
    """A token frame under `request_id`; `rest` is the worker's frame after its id's closing quote."""
    return b'{"id":' + _dumps(request_id) + rest + b"\n"


def encode_token(request_id: str, index: int, token_id: int, text: str) -> bytes:
    return _dumps(
        {"id": request_id, "status": STATUS_TOKEN, "index": index, "token_id": token_id, "text": text},
        option=_NL,
    )


def encode_authenticated(request_id: str | None) -> bytes:
    return _dumps({"id": request_id, "status": STATUS_AUTHENTICATED}, option=_NL)


def encode_pong(request_id: str) -> bytes:
    return _dumps({"id": request_id, "status": STATUS_PONG, "protocol": PROTOCOL_VERSION}, option=_NL)


def generate_frame(request_id: str, prompt: str, *, integrity: bool = True, **fields: Any) -> dict[str, Any]:
    """A client's generate frame, with `size` and `sha256` computed from the prompt's UTF-8 bytes."""
    frame: dict[str, Any] = {"id": request_id, "op": "generate", "prompt": prompt}
    frame.update(fields)
    if integrity:
        data = prompt.encode("utf-8")
        frame["size"] = len(data)
        frame["sha256"] = hashlib.sha256(data).hexdigest()
    return frame
