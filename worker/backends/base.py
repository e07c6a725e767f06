"""The contract between the worker's socket server and a backend (what generates the tokens).

A backend is the adapter that drives an engine for the server: `GPT2Backend` runs `LLMEngine` on a
thread of its own, `EchoBackend` echoes the prompt. The server hands it validated requests and a
sink per request; what it reports back are the contract's own types (`Completion`,
`EngineStats`), which the server encodes with the contract's encoders.
"""

from __future__ import annotations

from typing import Protocol

from govwire.errors import GovernorError
from govwire.messages import Completion, EngineStats
from govwire.request import GenerateRequest


class RequestSink(Protocol):
    """Where a backend reports one request's progress; `done` or `error` is called exactly once."""

    def token(self, index: int, token_id: int | None, text: str) -> None: ...

    def done(self, completion: Completion) -> None: ...

    def error(self, error: GovernorError) -> None: ...


class RequestHandle(Protocol):
    def cancel(self) -> object:
        """Stop generating; the sink then gets `done` with finish_reason `cancelled`."""


class Backend(Protocol):
    async def start(self) -> None:
        """Load what is needed; the worker listens only after this returns."""

    def submit(self, request: GenerateRequest, sink: RequestSink) -> RequestHandle: ...

    def stats(self) -> EngineStats:
        """What the governor exports as governor_worker_* metrics (fields a backend lacks stay None)."""

    async def close(self) -> None: ...
