from __future__ import annotations

import asyncio

from govwire.errors import GovernorError
from govwire.messages import Completion
from govwire.request import GenerateRequest
from worker.backends.echo import EchoBackend


class Recorder:
    def __init__(self) -> None:
        self.tokens: list[tuple[int, int | None, str]] = []
        self.completion: Completion | None = None
        self.errors: list[GovernorError] = []

    def token(self, index: int, token_id: int | None, text: str) -> None:
        self.tokens.append((index, token_id, text))

    def done(self, completion: Completion) -> None:
        assert self.completion is None, "done must be called once"
        self.completion = completion

    def error(self, error: GovernorError) -> None:
        self.errors.append(error)


def run(request: GenerateRequest, backend: EchoBackend | None = None) -> Recorder:
    async def main() -> Recorder:
        sink = Recorder()
        await (backend or EchoBackend()).submit(request, sink)
        return sink

    return asyncio.run(main())


def test_echoes_utf8_bytes_with_text_on_the_completing_byte() -> None:
    sink = run(GenerateRequest(id="a", prompt="hé", max_new_tokens=10))
    assert sink.tokens == [(0, 104, "h"), (1, 0xC3, ""), (2, 0xA9, "é")]
    assert sink.completion == Completion("hé", 3, 3, "eos", 0.0)


def test_a_character_cut_short_is_streamed_too_so_the_pieces_add_up() -> None:
    sink = run(GenerateRequest(id="a", prompt="hé", max_new_tokens=2))  # the é's first byte only
    assert sink.tokens == [(0, 104, "h"), (1, 0xC3, ""), (2, None, "\ufffd")]
    assert sink.completion == Completion("h\ufffd", 3, 2, "length", 0.0)
    assert "".join(text for _, _, text in sink.tokens) == sink.completion.text


def test_max_new_tokens_cuts_with_finish_reason_length() -> None:
    sink = run(GenerateRequest(id="a", prompt="hello", max_new_tokens=2))
    assert sink.completion is not None
    assert (sink.completion.text, sink.completion.finish_reason) == ("he", "length")


def test_without_stop_on_eos_the_prompt_repeats() -> None:
    sink = run(GenerateRequest(id="a", prompt="ab", max_new_tokens=5, stop_on_eos=False))
    assert sink.completion is not None and sink.completion.text == "ababa"


def test_empty_prompt_ends_at_once() -> None:
    sink = run(GenerateRequest(id="a", prompt="", max_new_tokens=5))
    assert sink.completion == Completion("", 0, 0, "eos", 0.0)


def test_cancel_ends_with_finish_reason_cancelled() -> None:
    async def main() -> Recorder:
        sink = Recorder()
        backend = EchoBackend(token_delay_ms=20)
        task = backend.submit(GenerateRequest(id="a", prompt="x" * 100, max_new_tokens=100), sink)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sink

    sink = asyncio.run(main())
    assert sink.completion is not None and sink.completion.finish_reason == "cancelled"
    assert 0 < sink.completion.completion_tokens < 100 == sink.completion.prompt_tokens


def test_cancel_before_the_task_starts_still_reports_done() -> None:
    async def main() -> Recorder:
        sink = Recorder()
        task = EchoBackend().submit(GenerateRequest(id="a", prompt="abc", max_new_tokens=3), sink)
        task.cancel()  # same loop iteration: the coroutine never runs
        await asyncio.gather(task, return_exceptions=True)
        return sink

    sink = asyncio.run(main())
    assert sink.completion == Completion("", 3, 0, "cancelled", 0.0)
