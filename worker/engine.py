"""The GPT-2 engine's synchronous core: add / cancel / step. One thread drives it (backends/gpt2.py).

`step()` = schedule → run → postprocess, as in nano-vllm. It returns the events of that step
(tokens, finished requests) instead of calling anyone, so it can be tested and benchmarked
without sockets or threads.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from govwire.errors import BadFrame
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason
from worker.cuda_graphs import CudaGraphCapture
from worker.loading import LoadedModel
from worker.runner import ModelRunner
from worker.scheduler import Chunk, Scheduler, SchedulerConfig
from worker.sequence import SamplingParams, Sequence
from worker.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True, slots=True)
class TokenEvent:
    seq: Sequence
    index: int
    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class FinishEvent:
    seq: Sequence
    completion: Completion


Event = TokenEvent | FinishEvent


@dataclass
class EngineCounters:
    """Monotonic totals since start; the governor exports them as worker_* metrics."""

    steps: int = 0
    step_sequences: int = 0  # summed over steps: mean batch size = step_sequences / steps
    prefill_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    busy_seconds: float = 0.0


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        max_context: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_context = max_context
        self.clock = clock
        self.counters = EngineCounters()
        self._eos = tokenizer.eos_token_id
        self._detokenizers: dict[Sequence, IncrementalDetokenizer] = {}

    @classmethod
    def for_model(cls, loaded: LoadedModel, config: SchedulerConfig, cuda_graphs: bool = True) -> LLMEngine:
        """An engine over a loaded model: its own paged KV cache of `config.num_blocks` blocks; on
        CUDA, decode steps replay graphs captured now unless `cuda_graphs` is False."""
        on_cuda = next(loaded.model.parameters()).device.type == "cuda"
        capture = CudaGraphCapture() if on_cuda and cuda_graphs else None
        runner = ModelRunner(loaded.model, config.num_blocks, config.kv_block_size, config.max_batch_size, capture)
        return cls(runner, loaded.tokenizer, Scheduler(config), max_context=loaded.shape.n_positions)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: GenerateRequest) -> Sequence:
        """Tokenize and queue a request (see `add_tokenized`)."""
        return self.add_tokenized(request, self.tokenizer.encode(request.prompt))

    def add_tokenized(self, request: GenerateRequest, prompt_ids: list[int]) -> Sequence:
        """Queue a request whose prompt is already tokenized (the worker tokenizes on a thread of
        its own); raises `BadFrame` if it can never run (never truncates silently)."""
        if not prompt_ids:
            raise BadFrame("prompt is empty: the model needs at least one prompt token", request.id)
        total = len(prompt_ids) + request.max_new_tokens
        if total > self.max_context:
            raise BadFrame(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} "
                f"exceeds the model context of {self.max_context} tokens",
                request.id,
            )
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p, request.seed)
        seq = Sequence(
            request.id, prompt_ids, request.max_new_tokens, sampling, request.stop_on_eos, t_arrival=self.clock()
        )
        if not sampling.is_greedy:
            seq.rng = random.Random(sampling.seed if sampling.seed is not None else secrets.randbits(63))
        if not self.scheduler.fits_ever(seq):
            config = self.scheduler.config
            raise BadFrame(
                f"prompt + max_new_tokens needs {seq.max_kv_tokens} KV cache tokens; the worker's cache holds "
                f"{config.num_blocks * config.kv_block_size} (--kv-cache-tokens {config.kv_cache_tokens} "
                f"in blocks of {config.kv_block_size})",
                request.id,
            )
        self._detokenizers[seq] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(seq)
        return seq

    def cancel(self, seq: Sequence) -> FinishEvent | None:
        """Take a request out at this step boundary; None if it already finished."""
        if seq not in self._detokenizers:
            return None
        return self._finish(seq, FinishReason.CANCELLED, self.clock())

    def fail_all(self) -> None:
        """Drop every request after a failed step (its state may be half-updated); blocks are freed.
        They end without a finish reason: their replies are errors (backends/gpt2.py)."""
        now = self.clock()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish(seq, None, now)
        self._detokenizers.clear()

    def step(self) -> list[Event]:
        """One batched forward: schedule → run → postprocess."""
        started = self.clock()
        chunks = self.scheduler.schedule(started)
        if not chunks:
            return []
        sampled = self.runner.run(chunks)
        return self._postprocess(chunks, sampled, started, self.clock())

    def _postprocess(self, chunks: list[Chunk], sampled: list[int], started: float, now: float) -> list[Event]:
        """Advance each scheduled sequence by its chunk; a sampled token is streamed, or ends it."""
        counters = self.counters
        counters.steps += 1
        counters.step_sequences += len(chunks)
        counters.busy_seconds += now - started
        tokens = iter(sampled)
        events: list[Event] = []
        for chunk in chunks:
            seq = chunk.seq
            if chunk.is_prefill:
                counters.prefill_tokens += chunk.num_tokens
            self.scheduler.computed(seq, chunk.end)
            if not chunk.samples:
                continue
            token = next(tokens)
            if seq.t_first_token is None:
                seq.t_first_token = now
            if token == self._eos and seq.stop_on_eos:
                events.append(self._finish(seq, FinishReason.EOS, now))
                continue
            seq.output_ids.append(token)
            counters.generated_tokens += 1
            detokenizer = self._detokenizers[seq]
            text = detokenizer.push(token)
            if len(seq.output_ids) < seq.max_new_tokens:
                events.append(TokenEvent(seq, len(seq.output_ids) - 1, token, text))
            else:
                events.append(TokenEvent(seq, len(seq.output_ids) - 1, token, text + detokenizer.flush()))
                events.append(self._finish(seq, FinishReason.LENGTH, now))
        return events

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> FinishEvent:
        self.scheduler.finish(seq, reason, now)
        del self._detokenizers[seq]
        self.counters.finished += 1
        return FinishEvent(seq, completion_of(seq, self.tokenizer.decode(seq.output_ids)))


def completion_of(seq: Sequence, text: str) -> Completion:
    def ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round((end - start) * 1000, 3)

    return Completion(
        text=text,
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=len(seq.output_ids),
        cached_prompt_tokens=seq.num_cached_prompt_tokens,
        finish_reason=seq.finish_reason or FinishReason.CANCELLED,
        queue_wait_ms=ms(seq.t_arrival, seq.t_admitted if seq.t_admitted is not None else seq.t_finished) or 0.0,
        prefill_ms=ms(seq.t_admitted, seq.t_first_token),
        worker_ttft_ms=ms(seq.t_arrival, seq.t_first_token),
        decode_ms=ms(seq.t_first_token, seq.t_finished),
    )
