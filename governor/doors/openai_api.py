"""The OpenAI-compatible API the front door serves (http.py), as pure functions over JSON values: no I/O.

A client's completions (or chat completions) body becomes a generate frame (the dict the NDJSON
port reads, so both doors share every later check), and the governor's answers become OpenAI
response bodies, stream chunks and error objects. (The other way, the governor as an OpenAI
client of an upstream server, is links/openai_stream.py.)

Only what maps one to one is accepted. A field the generate request has no meaning for (`n` > 1,
`stop`, `logprobs`, penalties, ...) is refused with `bad_frame` naming it, rather than ignored:
a client asking for three choices must not silently get one.
"""

from __future__ import annotations

from typing import Any

import orjson

from govwire.errors import BadFrame, GovernorError
from govwire.messages import Completion
from govwire.request import chat_messages
from govwire.vocab import ErrorCode, FinishReason, Op

DONE_EVENT = b"data: [DONE]\n\n"

# An OpenAI finish_reason for each of ours (links/openai_stream.py reads theirs).
FINISH_TO_OPENAI = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.CANCELLED: "cancelled"}

# Body fields of a completions request accepted when they ask for nothing beyond the default.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, 0),
    "stop": (None, [], ""),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
# Copied into the generate frame under the same name (validated there, as for NDJSON frames).
_SAME_NAME = ("temperature", "top_p", "top_k", "seed", "priority", "deadline_ms", "prompt_tokens")
_KNOWN = {"model", "prompt", "max_tokens", "stream", "stream_options", "user", "ignore_eos", *_NEUTRAL, *_SAME_NAME}


def _check_fields(body: Any, known: set[str], neutral: dict[str, tuple[object, ...]], request_id: str) -> None:
    """A JSON object naming only `known` fields, those in `neutral` at one of their default values."""
    if type(body) is not dict:
        raise BadFrame("the request body must be a JSON object", request_id)
    unknown = sorted(key for key in body if key not in known)
    if unknown:
        raise BadFrame(f"unsupported field {unknown[0]!r}", request_id, field=unknown[0])
    for key, defaults in neutral.items():
        if body.get(key) not in defaults:
            raise BadFrame(f"{key}={body[key]!r} is not supported (only the default)", request_id, field=key)


def _prompt_of(body: dict[str, Any]) -> Any:
    """The body's prompt; one prompt in a list is the same request."""
    prompt = body.get("prompt")
    return prompt[0] if type(prompt) is list and len(prompt) == 1 else prompt


def cost_view(body: dict[str, Any]) -> dict[str, Any]:
    """What `CostModel.ask` reads of a frame, from a completions body, without checking the rest
    (admission runs on this; `generate_frame_of` checks everything once a slot is granted)."""
    return {
        "prompt": _prompt_of(body),
        "max_new_tokens": body.get("max_tokens"),
        "prompt_tokens": body.get("prompt_tokens"),
        "deadline_ms": body.get("deadline_ms"),
        "priority": body.get("priority"),
        "stop_on_eos": body.get("ignore_eos") is not True,
    }


def generate_frame_of(body: Any, request_id: str) -> dict[str, Any]:
    """A completions request body as a generate frame (validated later, like any frame). Raises
    `BadFrame` for what cannot be expressed as one."""
    _check_fields(body, _KNOWN, _NEUTRAL, request_id)
    prompt = _prompt_of(body)
    if type(prompt) is not str:
        raise BadFrame(
            "prompt must be a string (one prompt; token arrays are not supported)", request_id, field="prompt"
        )
    frame: dict[str, Any] = {"id": request_id, "op": Op.GENERATE.value, "prompt": prompt}
    if body.get("max_tokens") is not None:
        frame["max_new_tokens"] = body["max_tokens"]
    for key in _SAME_NAME:
        if body.get(key) is not None:
            frame[key] = body[key]
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if type(ignore_eos) is not bool:
            raise BadFrame("ignore_eos must be a boolean", request_id, field="ignore_eos")
        frame["stop_on_eos"] = not ignore_eos
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise BadFrame("stream must be a boolean", request_id, field="stream")
    frame["stream"] = bool(stream)
    return frame


_CHAT_NEUTRAL = {
    **{k: v for k, v in _NEUTRAL.items() if k not in ("echo", "suffix", "best_of")},
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    # What SDK wrappers (LangChain, LiteLLM) send by default and changes nothing: no tools, plain
    # text out.
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
}
_CHAT_KNOWN = (_KNOWN - {"prompt", "echo", "suffix", "best_of"}) | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
}


_CHAT_ONLY = _CHAT_KNOWN - _KNOWN  # checked above; nothing a completions body would take


def chat_frame_of(body: Any, request_id: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """A chat completions body as a generate frame, whose `prompt` is the messages' text (what the
    cost is estimated from), and the messages themselves (`govwire.request.chat_messages`)."""
    _check_fields(body, _CHAT_KNOWN, _CHAT_NEUTRAL, request_id)
    messages = chat_messages(body.get("messages"), request_id)
    completion_like = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    completion_like["prompt"] = "\n".join(m["content"] for m in messages)
    if body.get("max_completion_tokens") is not None:
        completion_like["max_tokens"] = body["max_completion_tokens"]
    return generate_frame_of(completion_like, request_id), messages


def wants_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`: a last chunk with the usage and no choices."""
    options = body.get("stream_options")
    return type(options) is dict and options.get("include_usage") is True


def _usage(completion: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": completion.cached_prompt_tokens},
    }


def completion_response(request_id: str, model: str, created: int, completion: Completion) -> bytes:
    """The non-streaming response body."""
    return orjson.dumps(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": completion.text,
                    "logprobs": None,
                    "finish_reason": FINISH_TO_OPENAI[completion.finish_reason],
                }
            ],
            "usage": _usage(completion),
        }
    )


def chunk_event(
    request_id: str, model: str, created: int, text: str, finish_reason: FinishReason | None = None
) -> bytes:
    """One streamed chunk as a server-sent event."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": None if finish_reason is None else FINISH_TO_OPENAI[finish_reason],
    }
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def usage_event(request_id: str, model: str, created: int, completion: Completion, chat: bool = False) -> bytes:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": _usage(completion),
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def chat_response(request_id: str, model: str, created: int, completion: Completion) -> bytes:
    """The non-streaming chat response body."""
    message = {"role": "assistant", "content": completion.text}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": FINISH_TO_OPENAI[completion.finish_reason],
    }
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": [choice]}
    return orjson.dumps({**body, "usage": _usage(completion)})


def chat_chunk_event(
    request_id: str, model: str, created: int, text: str, finish_reason: FinishReason | None = None, role: bool = False
) -> bytes:
    """One streamed chat chunk: the first carries the role, the last the finish reason."""
    delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": None if finish_reason is None else FINISH_TO_OPENAI[finish_reason],
    }
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}

# A generate frame's fields by the names a completions body gives them (the rest are the same).
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "stop_on_eos": "ignore_eos"}


def error_object(status: int, code: str, message: str, param: str | None = None, **extra: Any) -> dict[str, Any]:
    """An OpenAI-style error (`{"error": {...}}`): `code` is the NDJSON error code or yield reason,
    `param` the body field at fault."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **extra}}


def error_body(status: int, error: GovernorError) -> bytes:
    """The error as the client's body named things: a frame field's check (`max_new_tokens must
    be …`) names the body's field (`max_tokens must be …`), which is also its `param`."""
    message, field = error.message, error.field
    if field is None:
        return orjson.dumps(error_object(status, error.code, message))
    param = OPENAI_NAMES.get(field, field)
    if param != field and message.startswith(field):
        message = param + message[len(field) :]
    return orjson.dumps(error_object(status, error.code, message, param))


def error_event(error: GovernorError) -> bytes:
    """An error after the stream began (its 200 is sent): one event, then the stream ends."""
    return b"data: " + orjson.dumps(error_object(500, error.code, error.message)) + b"\n\n"


# The HTTP status of each error code on the front door (unlisted: 500).
STATUS_OF_CODE: dict[str, int] = {
    ErrorCode.BAD_JSON: 400,
    ErrorCode.BAD_FRAME: 400,
    ErrorCode.INTEGRITY: 400,
    ErrorCode.OVER_BUDGET: 400,
    ErrorCode.TENANT_MISMATCH: 400,
    ErrorCode.DUPLICATE_ID: 400,
    ErrorCode.UNKNOWN_OP: 400,
    ErrorCode.FRAME_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.WORKER_UNAVAILABLE: 503,
    ErrorCode.WORKER_LOST: 502,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.FLEET_LEASE_LOST: 503,
    ErrorCode.IDLE_TIMEOUT: 408,
    ErrorCode.TOO_MANY_CONNECTIONS: 503,
    ErrorCode.BUFFER_FULL: 503,
}


def models_body(models: list[str], created: int) -> bytes:
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "governor"} for name in models],
        }
    )
