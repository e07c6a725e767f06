"""The echo backend: streams the prompt's UTF-8 bytes back as tokens, with configurable delays.

No model needed, so the governor can be tested and a deployment load-tested without a GPU.
Token ids are byte values; each token's text is what those bytes decode to so far (a multi-byte
character appears with its last byte). The prompt's end plays the part of end-of-sequence: with
`stop_on_eos` the echo stops there, without it the prompt repeats until `max_new_tokens`.
"""

from __future__ import annotations

import asyncio
import codecs

from govwire.messages import Completion, EngineStats
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason
from worker.backends.base import RequestSink


class EchoBackend:
    def __init__(self, token_delay_ms: float = 0.0, first_token_delay_ms: float = 0.0) -> None:
        self.token_delay_s = token_delay_ms / 1000.0
        self.first_token_delay_s = first_token_delay_ms / 1000.0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        return None

    def submit(self, request: GenerateRequest, sink: RequestSink) -> asyncio.Task[None]:
        task = asyncio.create_task(self._run(request, sink))
        self._tasks.add(task)

        def settle(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if task.cancelled():  # cancelled before its first step: _run never started to report
                prompt_tokens = len(request.prompt.encode("utf-8"))
                sink.done(Completion("", prompt_tokens, 0, FinishReason.CANCELLED, 0.0))

        task.add_done_callback(settle)
        return task

    async def _run(self, request: GenerateRequest, sink: RequestSink) -> None:
        data = request.prompt.encode("utf-8")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces: list[str] = []
        finish_reason = FinishReason.LENGTH
        try:
            if self.first_token_delay_s:
                await asyncio.sleep(self.first_token_delay_s)
            for index in range(request.max_new_tokens):
                if not data or (request.stop_on_eos and index >= len(data)):
                    finish_reason = FinishReason.EOS
                    break
                if index and self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                byte = data[index % len(data)]
                text = decoder.decode(bytes((byte,)))
                pieces.append(text)
                sink.token(index, byte, text)
        except asyncio.CancelledError:
            finish_reason = FinishReason.CANCELLED
        tokens = len(pieces)
        tail = decoder.decode(b"", final=True)
        if tail:  # a character's start no byte completed: streamed too, so the pieces add up
            sink.token(tokens, None, tail)
            pieces.append(tail)
        sink.done(
            Completion(
                text="".join(pieces),
                prompt_tokens=len(data),
                completion_tokens=tokens,
                finish_reason=finish_reason,
                queue_wait_ms=0.0,
            )
        )

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._tasks), step_seconds=self.token_delay_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
