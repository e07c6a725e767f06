"""The GPT-2 engine's core: add / cancel / step. One thread drives it (backends/gpt2.py).

`step()` = schedule → launch → postprocess, as in nano-vllm. It returns the events of that step
(tokens, finished requests) instead of calling anyone, so it can be tested and benchmarked
without sockets or threads.

With `overlap` (the default on a GPU) a step launches the next forward before it reads the last
one's tokens, as vLLM's async scheduling and SGLang's overlap scheduler do: the host schedules,
plans, detokenizes and emits step t while the device runs step t+1, which feeds each sequence its
step-t token from the device (runner.py). The price is paid at the edges: a sequence that samples
end-of-sequence, or is cancelled, at step t has already been given a row in step t+1, which is
thrown away; its blocks return when step t+1 is done (scheduler.py). A length stop is known when
scheduling and costs nothing. A step that would preempt, and stopping, first complete the step in
flight (`drain`); a failed step abandons it (`fail_all`: on CUDA the worker then exits).
Without overlap (the CPU, where the device is the host's own cores) the same code completes each
step before the next is scheduled. Both give the same tokens where a row's result does not depend
on the rest of its batch (the tests check it on the CPU): the two form different batches at the
edges (a thrown-away row, a block freed a step later).
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from govwire.errors import BadFrame
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason
from worker.cuda_graphs import CudaGraphCapture
from worker.loading import LoadedModel
from worker.prefill_budget import FLOOR, PrefillBudget
from worker.runner import ModelRunner, StepHandle
from worker.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from worker.sequence import SamplingParams, Sequence, SequenceStatus
from worker.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class TokenEvent:
    """A streamed token. Not frozen: one is made per token, and a frozen dataclass's `__init__`
    (an `object.__setattr__` per field) costs twice as much."""

    seq: Sequence
    index: int
    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """A request ended. `tail` is text its detokenizer still held (the start of a character no
    token completed): streamed before the `done` as a piece with no token of its own, so that the
    streamed pieces always add up to `completion.text`, whichever way the request ended."""

    seq: Sequence
    completion: Completion
    tail: str = ""


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
        overlap: bool = False,
        prefill_budget: PrefillBudget | None = None,
    ) -> None:
        """`prefill_budget`: beside decoding streams, a prompt budget learned from the steps'
        timing (None: `max_prefill_tokens` always); only without `overlap`, where a step's span
        holds another step's host work."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_context = max_context
        self.clock = clock
        self.overlap = overlap
        self.counters = EngineCounters()
        self._eos = tokenizer.eos_token_id
        self._detokenizers: dict[Sequence, IncrementalDetokenizer] = {}
        self._in_flight: _Launched | None = None
        if prefill_budget is not None and overlap:
            raise ValueError("a learned prefill budget needs steps that do not overlap")
        self.prefill_budget = prefill_budget
        self._last_done = 0.0  # when the last step completed: overlapping steps count busy time once

    @classmethod
    def for_model(
        cls,
        loaded: LoadedModel,
        config: SchedulerConfig,
        cuda_graphs: bool = True,
        overlap: bool | None = None,
        learned_prefill: bool = False,
    ) -> LLMEngine:
        """An engine over a loaded model: its own paged KV cache of `config.num_blocks` blocks; on
        CUDA, decode steps replay graphs captured now unless `cuda_graphs` is False, and steps
        overlap unless `overlap` is False (None: on CUDA only); `learned_prefill`: beside decoding
        streams, a prompt budget that follows the batch (prefill_budget.py), or its floor where
        steps overlap (their timing holds each other's host work). The KV cache is in the loaded
        model's `kv_dtype`."""
        on_cuda = next(loaded.model.parameters()).device.type == "cuda"
        capture = CudaGraphCapture() if on_cuda and cuda_graphs else None
        config = replace(config, max_model_len=config.max_model_len or loaded.shape.n_positions)
        runner = ModelRunner(loaded.model, config, capture, kv_dtype=loaded.kv_dtype)
        overlap = on_cuda if overlap is None else overlap
        engine = cls(
            runner,
            loaded.tokenizer,
            Scheduler(config),
            max_context=loaded.shape.n_positions,
            overlap=overlap,
            prefill_budget=PrefillBudget(config.max_prefill_tokens) if learned_prefill and not overlap else None,
        )
        if learned_prefill and overlap:  # no timing to learn from: the floor beside streams
            engine.scheduler.prefill_while_decoding = min(config.max_prefill_tokens, FLOOR)
        return engine

    @property
    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work

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
        self._in_flight = None
        self.scheduler.abandon_in_flight()
        now = self.clock()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish(seq, None, now)
        self._detokenizers.clear()

    def step(self) -> list[Event]:
        """One batched forward: schedule → launch → postprocess. With `overlap`, the step
        postprocessed is the one launched by the previous call, after this call's is launched."""
        started = self.clock()
        events: list[Event] = []
        if self._in_flight is not None and self._in_flight.handle.done():
            # The device is through it: what ended while it ran gives its blocks back now, not after
            # the step about to be launched (its tokens still wait for `_complete`).
            self.scheduler.step_done(self._in_flight.step.step)
        if self.prefill_budget is not None:  # for the batch about to decode
            rows = min(len(self.scheduler.running), self.scheduler.config.max_batch_size)
            self.scheduler.prefill_while_decoding = self.prefill_budget.while_decoding(rows)
        planned = self.scheduler.schedule(started, may_preempt=self._in_flight is None)
        if planned.needs_drain:
            events = self.drain()
            planned = self.scheduler.schedule(started)
        assert not planned.needs_drain  # nothing is in flight now
        scheduled = planned.step
        launched = None
        if scheduled is not None:
            launched = _Launched(scheduled, self.runner.launch(scheduled, self.scheduler.tables), started)
        previous, self._in_flight = self._in_flight, launched if self.overlap else None
        if previous is not None:
            events += self._complete(previous)
        if launched is not None and not self.overlap:
            events += self._complete(launched)
        return events

    def drain(self) -> list[Event]:
        """Complete the step in flight, if any."""
        launched, self._in_flight = self._in_flight, None
        return [] if launched is None else self._complete(launched)

    def _complete(self, launched: _Launched) -> list[Event]:
        """Wait for a step's tokens; each is streamed, or ends its sequence. A sequence that ended
        while the step was in flight gets nothing from it."""
        step = launched.step
        tokens = launched.handle.wait()
        now = self.clock()
        scheduler = self.scheduler
        scheduler.step_done(step.step)
        counters = self.counters
        counters.steps += 1
        counters.step_sequences += len(step.decode) + len(step.prefill)
        counters.busy_seconds += now - max(launched.started, self._last_done)
        self._last_done = now
        blocks = scheduler.blocks
        prompt_tokens = 0
        for chunk in step.prefill:
            prompt_tokens += chunk.end - chunk.start
            if chunk.seq.status is SequenceStatus.RUNNING:
                blocks.cache_computed(chunk.seq)
        counters.prefill_tokens += prompt_tokens
        if self.prefill_budget is not None:
            self.prefill_budget.observe(now - launched.started, len(step.decode), prompt_tokens)
        keying = blocks.prefix_caching
        block_size = blocks.block_size
        eos = self._eos
        detokenizers = self._detokenizers
        running = SequenceStatus.RUNNING
        events: list[Event] = []
        generated = 0
        for seq, token in zip(step.sampling, tokens, strict=True):
            seq.num_pending -= 1
            if seq.status is not running:  # ended while this step was in flight
                continue
            if seq.t_first_token is None:
                seq.t_first_token = now
            if token == eos and seq.stop_on_eos:
                if keying:  # the block this row filled, over the tokens before end-of-sequence
                    blocks.cache_computed(seq)
                events.append(self._finish(seq, FinishReason.EOS, now))
                continue
            output = seq.output_ids
            output.append(token)
            generated += 1
            if keying and seq.num_computed // block_size > seq.num_keyed_blocks:
                blocks.cache_computed(seq)
            detokenizer = detokenizers[seq]
            if len(output) < seq.max_new_tokens:
                events.append(TokenEvent(seq, len(output) - 1, token, detokenizer.push(token)))
            else:
                events.append(TokenEvent(seq, len(output) - 1, token, detokenizer.push(token) + detokenizer.flush()))
                events.append(self._finish(seq, FinishReason.LENGTH, now))
        counters.generated_tokens += generated
        return events

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> FinishEvent:
        self.scheduler.finish(seq, reason, now)
        tail = self._detokenizers.pop(seq).flush()
        self.counters.finished += 1
        return FinishEvent(seq, completion_of(seq, self.tokenizer.decode(seq.output_ids)), tail)


@dataclass(slots=True)
class _Launched:
    step: ScheduledStep
    handle: StepHandle
    started: float


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
