"""The generate request and every check of a client frame: pure functions over decoded JSON, no I/O.

Checks run in three steps so that shedding load stays cheap. `frame_op` (the envelope: object, id,
op) runs before admission; `validate_generate` (every field) and `verify_integrity` (hashes the
prompt) run only once a slot was granted, and a failure refunds the slot. A yield therefore costs
little more than parsing, whatever the frame's size, and says nothing about the frame's validity.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from govwire.errors import BadFrame, IntegrityMismatch, UnknownOp
from govwire.vocab import Op, Priority

_OPS: dict[str, Op] = {op.value: op for op in Op}
_OP_NAMES = ", ".join(_OPS)

# Ids are echoed in every reply and kept as dict keys while in flight: bound them.
MAX_ID_CHARS = 256
MAX_SEED = 2**64 - 1
DEFAULT_MAX_NEW_TOKENS = 16
MAX_DECLARED_TOKENS = 2**31 - 1  # a declared prompt_tokens is a claim: bounded, settled with the truth
MAX_DEADLINE_MS = 86_400_000  # a day: a longer wait for a first token is no deadline
_is_hex64 = re.compile(r"[0-9a-f]{64}").fullmatch
MAX_TENANT_CHARS = 64
MAX_MESSAGES = 1024
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
is_tenant_name = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_TENANT_CHARS}}}").fullmatch
"""A tenant's name: it is a metric label and a log field, so a plain bounded word."""
_PRIORITIES = frozenset(p.value for p in Priority)


class IntegrityMode(StrEnum):
    REQUIRED = "required"
    OPTIONAL = "optional"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class Limits:
    max_new_tokens: int = 4096
    integrity: IntegrityMode = IntegrityMode.REQUIRED


def is_int(value: object) -> bool:
    # bool is a subclass of int; JSON true must not pass as 1.
    return type(value) is int


def is_number(value: object) -> bool:
    return type(value) is int or type(value) is float


def frame_op(obj: Any) -> Op:
    """Check a frame's envelope (object, id, op) and return its op.

    This is all that runs before admission; see `validate_generate` for the rest.
    """
    if type(obj) is not dict:
        raise BadFrame("frame must be a JSON object")
    rid = obj.get("id")
    if type(rid) is not str or not 0 < len(rid) <= MAX_ID_CHARS:
        raise BadFrame(f"id must be a non-empty string of at most {MAX_ID_CHARS} characters")
    op = obj.get("op")
    if op is None:
        return Op.GENERATE
    if type(op) is not str:  # before the lookup: a list or object is unhashable
        raise BadFrame("op must be a string", rid)
    known = _OPS.get(op)
    if known is not None:
        return known
    raise UnknownOp(f"unknown op {op[:64]!r}; expected one of {_OP_NAMES}", rid)


def chat_messages(raw: Any, rid: str | None) -> list[dict[str, str]]:
    """A chat's `messages`, checked and with text parts joined: [{role, content}], content a str.
    Text only: a list of parts must be all text (no images, no tool calls)."""
    if type(raw) is not list or not 0 < len(raw) <= MAX_MESSAGES:
        raise BadFrame(f"messages must be a list of 1 to {MAX_MESSAGES} messages", rid, field="messages")
    messages: list[dict[str, str]] = []
    for i, message in enumerate(raw):
        role = message.get("role") if type(message) is dict else None
        if type(role) is not str or role not in CHAT_ROLES or set(message) - {"role", "content", "name"}:
            raise BadFrame(
                f"messages[{i}] must be {{role: system|developer|user|assistant, content}}", rid, field="messages"
            )
        content = message.get("content")
        if type(content) is list and all(type(p) is dict and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if type(content) is not str:
            raise BadFrame(f"messages[{i}].content must be text", rid, field="messages")
        messages.append({"role": role, "content": content})
    return messages


def validate_generate(obj: dict[str, Any], limits: Limits) -> None:
    """Type and range checks of a generate frame's fields. Raises `BadFrame` naming the field.
    A chat's `messages` are left normalised in `obj` (see `chat_messages`)."""
    rid = obj["id"]
    if type(obj.get("prompt")) is not str:
        raise BadFrame("prompt must be a string", rid, field="prompt")
    v = obj.get("messages")
    if v is not None:
        obj["messages"] = chat_messages(v, rid)
    n = obj.get("max_new_tokens")
    if n is not None and not (is_int(n) and 1 <= n <= limits.max_new_tokens):
        raise BadFrame(
            f"max_new_tokens must be an integer in [1, {limits.max_new_tokens}]", rid, field="max_new_tokens"
        )
    v = obj.get("temperature")
    if v is not None and not (is_number(v) and v >= 0):
        raise BadFrame("temperature must be a number >= 0", rid, field="temperature")
    v = obj.get("top_p")
    if v is not None and not (is_number(v) and 0 < v <= 1):
        raise BadFrame("top_p must be a number in (0, 1]", rid, field="top_p")
    v = obj.get("top_k")
    if v is not None and not (is_int(v) and v >= 0):
        raise BadFrame("top_k must be an integer >= 0 (0 disables it)", rid, field="top_k")
    v = obj.get("seed")
    if v is not None and not (is_int(v) and 0 <= v <= MAX_SEED):
        raise BadFrame(f"seed must be an integer in [0, {MAX_SEED}]", rid, field="seed")
    v = obj.get("stop_on_eos")
    if v is not None and type(v) is not bool:
        raise BadFrame("stop_on_eos must be a boolean", rid, field="stop_on_eos")
    v = obj.get("stream")
    if v is not None and type(v) is not bool:
        raise BadFrame("stream must be a boolean", rid, field="stream")
    v = obj.get("ack")
    if v is not None and type(v) is not bool:
        raise BadFrame("ack must be a boolean", rid, field="ack")
    v = obj.get("prompt_tokens")
    if v is not None and not (is_int(v) and 0 <= v <= MAX_DECLARED_TOKENS):
        raise BadFrame(f"prompt_tokens must be an integer in [0, {MAX_DECLARED_TOKENS}]", rid, field="prompt_tokens")
    v = obj.get("deadline_ms")
    if v is not None and not (is_number(v) and 0 < v <= MAX_DEADLINE_MS):
        raise BadFrame(f"deadline_ms must be a number in (0, {MAX_DEADLINE_MS}]", rid, field="deadline_ms")
    v = obj.get("tenant")
    if v is not None and not (type(v) is str and is_tenant_name(v)):
        raise BadFrame(f"tenant must be 1 to {MAX_TENANT_CHARS} characters of A-Z a-z 0-9 _ . -", rid, field="tenant")
    v = obj.get("priority")
    if v is not None and (type(v) is not str or v not in _PRIORITIES):
        raise BadFrame(f"priority must be one of {', '.join(sorted(_PRIORITIES))}", rid, field="priority")
    if limits.integrity is IntegrityMode.OFF:
        return
    size = obj.get("size")
    digest = obj.get("sha256")
    if limits.integrity is IntegrityMode.REQUIRED and (size is None or digest is None):
        raise BadFrame("size and sha256 are required (server runs with --integrity required)", rid)
    if size is not None and not (is_int(size) and size >= 0):
        raise BadFrame("size must be an integer >= 0", rid, field="size")
    if digest is not None and not (type(digest) is str and _is_hex64(digest)):
        raise BadFrame("sha256 must be 64 lowercase hex characters", rid, field="sha256")


def verify_integrity(obj: dict[str, Any], limits: Limits) -> None:
    """Check declared size and digest against the prompt's UTF-8 bytes (after `validate_generate`)."""
    if limits.integrity is IntegrityMode.OFF:
        return
    size = obj.get("size")
    digest = obj.get("sha256")
    if size is None and digest is None:
        return
    data = obj["prompt"].encode("utf-8")
    rid = obj["id"]
    if size is not None and size != len(data):
        raise IntegrityMismatch(f"size mismatch: declared {size}, prompt has {len(data)} bytes", rid)
    if digest is not None and digest != hashlib.sha256(data).hexdigest():
        raise IntegrityMismatch("sha256 mismatch: digest of the prompt bytes differs", rid)


def checked_request(obj: dict[str, Any], limits: Limits) -> GenerateRequest:
    """Every check after the envelope, in order (fields, then integrity), and the request they allow."""
    validate_generate(obj, limits)
    verify_integrity(obj, limits)
    return GenerateRequest.from_frame(obj, limits)


def _field(obj: dict[str, Any], key: str, default: Any) -> Any:
    # JSON null means "not given" for every optional field, as in validate_generate.
    value = obj.get(key)
    return default if value is None else value


@dataclass(slots=True)
class GenerateRequest:
    """A validated generate request, as forwarded to a worker. Read-only by convention, not
    `frozen`, for the reason `messages.Completion` gives: one is built for every admitted frame."""

    id: str
    prompt: str
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_on_eos: bool = True
    stream: bool = True
    ack: bool = False  # answer `accepted` once admitted; a client-side option, not forwarded
    # A chat: what the model is given, rendered by the worker's chat template (an OpenAI-compatible
    # endpoint gets them as they are); `prompt` is then the messages' text, for the cost estimate.
    messages: list[dict[str, str]] | None = None

    @classmethod
    def from_frame(cls, obj: dict[str, Any], limits: Limits) -> GenerateRequest:
        """Build from a frame that passed `validate_generate`; absent or null fields take the defaults
        (the default token count never exceeds the server's limit)."""
        return cls(
            id=obj["id"],
            prompt=obj["prompt"],
            max_new_tokens=_field(obj, "max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens)),
            temperature=float(_field(obj, "temperature", 1.0)),
            top_p=float(_field(obj, "top_p", 1.0)),
            top_k=_field(obj, "top_k", 0),
            seed=obj.get("seed"),
            stop_on_eos=_field(obj, "stop_on_eos", True),
            ack=_field(obj, "ack", False),
            stream=_field(obj, "stream", True),
            messages=obj.get("messages"),
        )

    def to_frame(self) -> dict[str, Any]:
        frame = {
            "id": self.id,
            "op": Op.GENERATE.value,
            "prompt": self.prompt,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_on_eos": self.stop_on_eos,
            "stream": self.stream,
        }
        if self.messages is not None:
            frame["messages"] = self.messages
        return frame
