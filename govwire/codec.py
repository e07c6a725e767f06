"""The bytes of protocol v1: decoding a frame, and one encoder for every reply (docs/protocol.md).

Each encoder is a single `orjson.dumps` with the newline appended by orjson, because these run on
the hot paths: a yield per refused frame, a token per generated token. Imports only the stdlib,
orjson and the rest of the contract.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from govwire.errors import BadJson, GovernorError
from govwire.messages import Completion, EngineStats
from govwire.vocab import PROTOCOL_VERSION, Op, ReservedId, Status

_NL = orjson.OPT_APPEND_NEWLINE
_dumps = orjson.dumps
# Plain strings for the encoders on hot paths: on CPython 3.11 an enum member read through its
# class costs ~75 ns, a module global a few.
_ACCEPTED = Status.ACCEPTED.value
_TOKEN = Status.TOKEN.value
_YIELD = Status.YIELD.value
_ERROR = Status.ERROR.value
_DONE = Status.DONE.value


def bad_json(exc: orjson.JSONDecodeError) -> BadJson:
    return BadJson(f"invalid JSON: {exc}")


def decode(line: bytes) -> Any:
    """One frame's bytes to a Python value; any parse failure is `BadJson`."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise bad_json(exc) from None


def encode(obj: dict[str, Any]) -> bytes:
    """One frame, newline-terminated (request frames; replies have their own encoders below)."""
    return _dumps(obj, option=_NL)


def encode_accepted(request_id: str) -> bytes:
    return _dumps({"id": request_id, "status": _ACCEPTED}, option=_NL)


def encode_yield(
    request_id: str, retry_hint_ms: int, reason: str, retry_ticket: str | None = None, final: bool = False
) -> bytes:
    """A yield; with `retry_ticket` when the governor keeps an appointment for the client (a retry
    sending it back by `retry_hint_ms` is the one let in); with `final` when it keeps none because
    nothing frees within its promise horizon: do not come back (`retry_hint_ms` is then at least
    the horizon: the forecast where one was made, else the horizon itself)."""
    reply: dict[str, object] = {"id": request_id, "status": _YIELD, "retry_hint_ms": retry_hint_ms, "reason": reason}
    if retry_ticket is not None:
        reply["retry_ticket"] = retry_ticket
    if final:
        reply["final"] = True
    return _dumps(reply, option=_NL)


def encode_error(error: GovernorError, request_id: str | None = None) -> bytes:
    rid = error.request_id if request_id is None else request_id
    return _dumps({"id": rid, "status": _ERROR, "code": error.code, "message": error.message}, option=_NL)


def encode_token(request_id: str, index: int, token_id: int | None, text: str) -> bytes:
    """A token frame; `token_id` is None for text relayed from an OpenAI-compatible endpoint."""
    return _dumps({"id": request_id, "status": _TOKEN, "index": index, "token_id": token_id, "text": text}, option=_NL)


# A token frame as encode_token writes it: `{"id":"<id>","status":"token",...}`. The governor
# re-addresses these without parsing them (governor/links/worker_link.py), the one frame every generated token costs.
TOKEN_FRAME_HEAD = b'{"id":"'
TOKEN_FRAME_STATUS = b'","status":"token"'


def readdress_token(rest: bytes, request_id: str) -> bytes:
    """A token frame under `request_id`; `rest` is the worker's frame after its id's closing quote."""
    return b'{"id":' + _dumps(request_id) + rest + b"\n"


def encode_done(
    request_id: str, completion: Completion, *, total_ms: float | None = None, ttft_ms: float | None = None
) -> bytes:
    """The `done` frame. A worker sends the completion; the governor adds its own `total_ms` and
    `ttft_ms` (measured from the frame's arrival) when it answers the client. Timings are written
    as given: whoever measures them rounds them (to µs)."""
    frame: dict[str, Any] = {
        "id": request_id,
        "status": _DONE,
        "text": completion.text,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "cached_prompt_tokens": completion.cached_prompt_tokens,
        "finish_reason": completion.finish_reason,  # a StrEnum member: orjson writes its value
        "queue_wait_ms": completion.queue_wait_ms,
    }
    for key, value in (
        ("prefill_ms", completion.prefill_ms),
        ("worker_ttft_ms", completion.worker_ttft_ms),
        ("decode_ms", completion.decode_ms),
        ("total_ms", total_ms),
        ("ttft_ms", ttft_ms),
    ):
        if value is not None:
            frame[key] = value
    return _dumps(frame, option=_NL)


def encode_stats_push(stats: EngineStats) -> bytes:
    """A worker's `~stats` push."""
    return _dumps({"id": ReservedId.STATS.value, "status": Status.STATS.value, **stats.to_dict()}, option=_NL)


def encode_stats(request_id: str, body: dict[str, Any]) -> bytes:
    """The governor's answer to a `stats` frame; `body` is its snapshot (docs/protocol.md)."""
    return _dumps({**body, "id": request_id, "status": Status.STATS.value}, option=_NL)


def encode_authenticated(request_id: str | None) -> bytes:
    return _dumps({"id": request_id, "status": Status.AUTHENTICATED.value}, option=_NL)


def encode_pong(request_id: str) -> bytes:
    return _dumps({"id": request_id, "status": Status.PONG.value, "protocol": PROTOCOL_VERSION}, option=_NL)


def encode_ping(request_id: str) -> bytes:
    return _dumps({"id": request_id, "op": Op.PING.value}, option=_NL)


def encode_cancel(request_id: str) -> bytes:
    return _dumps({"id": request_id, "op": Op.CANCEL.value}, option=_NL)


def generate_frame(request_id: str, prompt: str, *, integrity: bool = True, **fields: Any) -> dict[str, Any]:
    """A client's generate frame, with `size` and `sha256` computed from the prompt's UTF-8 bytes."""
    frame: dict[str, Any] = {"id": request_id, "op": Op.GENERATE.value, "prompt": prompt}
    frame.update(fields)
    if integrity:
        data = prompt.encode("utf-8")
        frame["size"] = len(data)
        frame["sha256"] = hashlib.sha256(data).hexdigest()
    return frame
