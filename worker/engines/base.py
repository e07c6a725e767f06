"""The contract between the worker's socket server and an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from governor.errors import GovernorError
from governor.validation import GenerateRequest


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request. Timings are the worker's own, in milliseconds; None where not reached."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "length" | "eos" | "cancelled"
    queue_wait_ms: float  # arrival at the worker -> admitted to the batch (its prefill starts)
    prefill_ms: float | None = None  # admitted -> first token sampled (all prompt chunks)
    worker_ttft_ms: float | None = None  # arrival at the worker -> first token sampled
    decode_ms: float | None = None  # first token -> finished


class RequestSink(Protocol):
    """Where an engine reports one request's progress; `done` or `error` is called exactly once."""

    def token(self, index: int, token_id: int, text: str) -> None: ...

    def done(self, completion: Completion) -> None: ...

    def error(self, error: GovernorError) -> None: ...


class RequestHandle(Protocol):
    def cancel(self) -> object:
        """Stop generating; the sink then gets `done` with finish_reason `cancelled`."""


class Engine(Protocol):
    async def start(self) -> None:
        """Load what is needed; the worker listens only after this returns."""

    def submit(self, request: GenerateRequest, sink: RequestSink) -> RequestHandle: ...

    def stats(self) -> dict[str, float]:
        """Counters (`*_total`, monotonic) and gauges for the governor's worker_* metrics."""

    async def close(self) -> None: ...
