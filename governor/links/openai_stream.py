"""A streamed completion from an OpenAI-compatible server, as the link speaks it (openai_link.py),
as pure functions over JSON values: no I/O.

A validated `GenerateRequest` becomes a streaming `POST /v1/completions` (or `/chat/completions`)
body, each server-sent chunk is read back as a `Chunk`, and a full server's 429/503 names its
wait in `Retry-After`. (The other way, the governor as an OpenAI server, is doors/openai_api.py.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import orjson

from governor.admission.endpoint import OpenAITarget
from govwire.errors import BadFrame
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason

MAX_RETRY_AFTER_S = 60.0  # an upstream's Retry-After beyond this is read as this

# Ours for each OpenAI finish_reason (doors/openai_api.py writes theirs).
FINISH_FROM_OPENAI = {"length": FinishReason.LENGTH, "stop": FinishReason.EOS}


def completion_body(generate: GenerateRequest, target: OpenAITarget) -> tuple[str, dict[str, Any]]:
    """The path (`/completions`, or `/chat/completions` for a chat request) and streaming body for
    an admitted request. Always streamed, with usage, so that the first token is seen when it
    comes and token counts come back at the end. `top_k` has no OpenAI field: refused, naming
    it; `stop_on_eos=false` goes as `ignore_eos: true` (vLLM's, SGLang's and llama.cpp's field)
    unless the endpoint says `ignore_eos=refuse`."""
    if generate.top_k:
        raise BadFrame("top_k is not supported by OpenAI-compatible endpoints (send 0 or omit it)", generate.id)
    body: dict[str, Any] = {"model": target.model}
    if not generate.stop_on_eos:
        if target.ignore_eos == "refuse":
            raise BadFrame("ignore_eos is not supported by this endpoint (its ignore_eos=refuse)", generate.id)
        body["ignore_eos"] = True
    if generate.messages is None:
        body["prompt"] = generate.prompt
    else:
        body["messages"] = generate.messages
    body.update(
        {
            "max_tokens": generate.max_new_tokens,
            "temperature": generate.temperature,
            "top_p": generate.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    if generate.seed is not None:
        body["seed"] = generate.seed
    return ("/completions" if generate.messages is None else "/chat/completions"), body


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """One server-sent completions chunk: its text (may be empty), finish reason, usage."""

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class UpstreamProtocolError(ValueError):
    """The upstream sent something that is not a completions chunk (or an error in the stream)."""


def _count(value: object, name: str) -> int:
    if type(value) is not int or value < 0:
        raise UpstreamProtocolError(f"usage.{name} must be an integer >= 0, got {value!r}")
    return value


def read_chunk(data: bytes | str) -> Chunk:
    """Parse one SSE `data:` payload of a streaming completion (not `[DONE]`)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError(f"chunk is not JSON: {exc}") from None
    if type(obj) is not dict:
        raise UpstreamProtocolError("chunk is not a JSON object")
    if "error" in obj:
        raise UpstreamProtocolError(f"upstream error in the stream: {str(obj['error'])[:300]}")
    text, finish = "", None
    choices = obj.get("choices") or []
    if type(choices) is not list:
        raise UpstreamProtocolError("choices must be a list")
    if choices:
        choice = choices[0]
        if type(choice) is not dict:
            raise UpstreamProtocolError("a choice must be an object")
        delta = choice.get("delta")  # a chat chunk: the text is the delta's content
        text = (delta.get("content") if type(delta) is dict else choice.get("text")) or ""
        if type(text) is not str:
            raise UpstreamProtocolError("choices[0].text (or delta.content) must be a string")
        reason = choice.get("finish_reason")
        if reason is not None:
            finish = FINISH_FROM_OPENAI.get(reason, FinishReason.EOS)  # content_filter etc.: ended by the model
    usage = None
    raw = obj.get("usage")
    if type(raw) is dict:
        details = raw.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if type(details) is dict else None
        prompt = _count(raw.get("prompt_tokens"), "prompt_tokens")
        usage = Usage(prompt, _count(raw.get("completion_tokens"), "completion_tokens"), min(cached or 0, prompt))
    return Chunk(text, finish, usage)


def retry_after_s(headers: dict[str, str]) -> float | None:
    """The wait an upstream's 429/503 asks for: `retry-after-ms` first (as the OpenAI SDK reads
    it), then `Retry-After` in seconds or as an HTTP date; None when it gives none. At most
    `MAX_RETRY_AFTER_S`."""
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            wait = float(value) / 1000
        except ValueError:
            wait = math.nan
        if math.isfinite(wait) and wait >= 0:
            return min(wait, MAX_RETRY_AFTER_S)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        wait = float(value)
    except ValueError:
        try:
            wait = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    if not math.isfinite(wait):
        return None
    return min(max(wait, 0.0), MAX_RETRY_AFTER_S)
