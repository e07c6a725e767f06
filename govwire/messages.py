"""Typed payloads of the frames a worker sends back: the `done` frame and the `~stats` push.

Both processes build and read these instead of anonymous dicts (vLLM v1 does the same with its
`EngineCoreOutput`s): the worker fills a `Completion` or an `EngineStats`, codec.py writes it, and
the governor reads it back with `from_frame`, which checks every field's type, so a malformed
frame from a worker is refused where it enters and not where a field is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from govwire.request import is_number
from govwire.vocab import FinishReason

_FINISH_REASONS = {reason.value: reason for reason in FinishReason}  # a dict: FinishReason(x) is slow


@dataclass(slots=True)
class Completion:
    """A finished request, as the `done` frame carries it. Timings are the worker's own, in
    milliseconds; None where not reached (a request cancelled before its first token has no
    prefill).

    Read-only by convention, not `frozen`: a frozen dataclass sets each field through
    `object.__setattr__` (5x slower to build: 0.86 against 0.17 µs for eight fields here), and
    the governor builds one for every request it relays."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    queue_wait_ms: float  # arrival at the worker -> admitted to the batch (its prefill starts)
    prefill_ms: float | None = None  # admitted -> first token sampled (all prompt chunks)
    worker_ttft_ms: float | None = None  # arrival at the worker -> first token sampled
    decode_ms: float | None = None  # first token -> finished
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> Completion:
        """Read a worker's `done` frame; ValueError names the first field that is wrong."""
        text = frame.get("text")
        if type(text) is not str:
            raise ValueError("done: text must be a string")
        prompt_tokens, completion_tokens = frame.get("prompt_tokens"), frame.get("completion_tokens")
        if not (
            type(prompt_tokens) is int and type(completion_tokens) is int and min(prompt_tokens, completion_tokens) >= 0
        ):
            raise ValueError("done: prompt_tokens and completion_tokens must be integers >= 0")
        cached = frame.get("cached_prompt_tokens", 0)
        if not (type(cached) is int and 0 <= cached <= prompt_tokens):
            raise ValueError("done: cached_prompt_tokens must be an integer between 0 and prompt_tokens")
        finish_reason = frame.get("finish_reason")
        reason = _FINISH_REASONS.get(finish_reason) if type(finish_reason) is str else None
        if reason is None:
            raise ValueError(f"done: unknown finish_reason {frame.get('finish_reason')!r}")
        # Read for every request the governor relays: straight-line checks, no helper calls.
        queue_wait = frame.get("queue_wait_ms", 0.0)
        prefill = frame.get("prefill_ms")
        worker_ttft = frame.get("worker_ttft_ms")
        decode = frame.get("decode_ms")
        for key, value in (
            ("queue_wait_ms", queue_wait),
            ("prefill_ms", prefill),
            ("worker_ttft_ms", worker_ttft),
            ("decode_ms", decode),
        ):
            if value is not None and type(value) is not float and type(value) is not int:
                raise ValueError(f"done: {key} must be a number")
        return cls(
            text, prompt_tokens, completion_tokens, reason, queue_wait or 0.0, prefill, worker_ttft, decode, cached
        )


def _stat(help_text: str) -> Any:
    return field(default=None, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The statistics a worker pushes under the reserved id `~stats`, about once a second; the
    governor exports each field as `governor_worker_<name>` per endpoint (a `_total` field is a
    counter, restarting at 0 with the worker; the rest are gauges). A backend fills what it has;
    None fields are not sent."""

    steps_total: int | None = _stat("Engine steps (one batched forward each).")
    step_sequences_total: int | None = _stat("Sequences summed over steps; / steps = mean batch size.")
    prefill_tokens_total: int | None = _stat("Prompt tokens run through the model.")
    generated_tokens_total: int | None = _stat("Tokens generated (streamed to clients).")
    finished_total: int | None = _stat("Requests the engine finished (any finish reason).")
    busy_seconds_total: float | None = _stat("Seconds spent in engine steps; its rate is the engine's utilisation.")
    running: int | None = _stat("Sequences in the running batch (prefilling or decoding).")
    waiting: int | None = _stat("Requests queued inside the worker, waiting for a batch slot or KV cache room.")
    kv_cache_used_tokens: int | None = _stat("KV cache rows in blocks held by running sequences.")
    kv_cache_capacity_tokens: int | None = _stat("KV cache size in tokens (whole blocks of --kv-cache-tokens).")
    kv_cache_bytes: int | None = _stat("Bytes of the preallocated KV cache.")
    kv_cache_usage_ratio: float | None = _stat(
        "Share of the KV cache's blocks held by running sequences (0-1; vLLM's kv_cache_usage_perc)."
    )
    kv_cache_capacity_blocks: int | None = _stat("KV cache blocks in the pool.")
    kv_cache_used_blocks: int | None = _stat("KV cache blocks held by running sequences.")
    kv_cache_cached_blocks: int | None = _stat("Unheld KV blocks keeping a prefix for reuse (evicted when needed).")
    kv_cache_free_blocks: int | None = _stat("KV cache blocks holding nothing.")
    prefix_cache_queries_tokens_total: int | None = _stat("Prompt tokens looked up in the prefix cache.")
    prefix_cache_hits_tokens_total: int | None = _stat("Prompt tokens found in the prefix cache (not prefilled).")
    preemptions_total: int | None = _stat("Running sequences preempted for KV cache room (recomputed when readmitted).")
    max_batch_size: int | None = _stat("The decode batch: most decoding sequences in one step (--max-batch-size).")
    max_running: int | None = _stat(
        "Most sequences admitted into the engine at once (--max-running); past it, requests wait in the worker."
    )
    max_prefill_tokens: int | None = _stat("Prompt tokens prefilled per step (--max-prefill-tokens).")
    step_seconds: float | None = _stat(
        "Seconds per engine step: the mean over its steps so far, or what it is set to take (the echo"
        " engine's token delay). The governor's release forecast assumes it before any stream ended."
    )

    def to_dict(self) -> dict[str, int | float]:
        """The fields that are set, by name (the body of the `~stats` frame)."""
        return {name: value for name in STATS_FIELDS if (value := getattr(self, name)) is not None}

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> EngineStats:
        """Read a `~stats` frame: known fields holding numbers; others are ignored (a newer worker
        may report more than this governor exports)."""
        return cls(**{name: frame[name] for name in STATS_FIELDS if is_number(frame.get(name))})


STATS_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineStats))
STATS_HELP: dict[str, str] = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineStats)}
