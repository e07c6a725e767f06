"""Continuous batching: who runs in the next forward pass. No torch, so it is unit-tested alone.

Every step is one forward over a packed batch: one token for each running sequence that is
decoding, plus prompt chunks of sequences that are prefilling. Prefill and decode share the
forward (the weights are read once for both, and on CPU a larger matrix multiply is more
efficient), while `max_prefill_tokens` caps the prompt tokens per step so that a long prompt
delays the running sequences' next token by a bounded amount: a longer prompt is split into
chunks over several steps. Sequences join at any step boundary and leave the moment they finish.

Three knobs shape a step, after the token budget:
- `max_batch_size` is the decode batch: most decoding sequences per step (a sequence whose
  prefill completes in the step samples its first token too, outside this count);
- `max_running` (default: `max_batch_size`) bounds the admitted sequences, those holding a KV span.
  Above the decode batch, running sequences take turns, the one whose last turn is oldest first:
  requests get their first token sooner and each later token later (TTFT bought with TPOT);
- `prefill_max_batch_size` bounds admissions per step: how fast a burst moves from waiting into
  prefill, independently of the decode batch.

Admission is FIFO and needs room in the running set, a free admission this step and a free KV
span for the sequence's whole life (prompt + max_new_tokens - 1). A head request that does not fit
blocks those behind it, so a large request is not starved by a stream of small ones; while it
waits, its wait is queue wait.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from govwire.vocab import FinishReason
from worker.kv_allocator import SpanAllocator
from worker.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 32
    prefill_max_batch_size: int = 32
    max_prefill_tokens: int = 2048
    kv_cache_tokens: int = 32768
    max_running: int = 0  # 0 = max_batch_size

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "prefill_max_batch_size", "max_prefill_tokens", "kv_cache_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_running < 0:
            raise ValueError("max_running must be >= 0")

    @property
    def running_cap(self) -> int:
        return self.max_running or self.max_batch_size


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [start, end) of `seq` go through the model this step; `samples` if a token follows."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.start < self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = SpanAllocator(config.kv_cache_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fits_ever(self, seq: Sequence) -> bool:
        return seq.kv_tokens_needed <= self.config.kv_cache_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float) -> list[Chunk]:
        """The next step's chunks: decodes first, then prompt chunks up to the prefill budget."""
        config = self.config
        self._steps += 1
        decoding = [seq for seq in self.running if not seq.is_prefilling]
        if len(decoding) > config.max_batch_size:
            decoding = heapq.nsmallest(config.max_batch_size, decoding, key=lambda seq: seq.last_step)
        chunks = [Chunk(seq, seq.num_computed, seq.num_tokens) for seq in decoding]
        budget = config.max_prefill_tokens
        for seq in self.running:
            if budget and seq.is_prefilling:
                budget -= self._add_prefill_chunk(chunks, seq, budget)
        admitted = 0
        waiting = self.waiting
        while (
            budget and waiting and admitted < config.prefill_max_batch_size and len(self.running) < config.running_cap
        ):
            seq = waiting[0]
            start = self.kv.allocate(seq.kv_tokens_needed)
            if start is None:
                break
            waiting.popleft()
            seq.kv_start = start
            seq.status = SequenceStatus.RUNNING
            seq.t_admitted = now
            self.running.append(seq)
            admitted += 1
            budget -= self._add_prefill_chunk(chunks, seq, budget)
        for chunk in chunks:
            chunk.seq.last_step = self._steps
        return chunks

    @staticmethod
    def _add_prefill_chunk(chunks: list[Chunk], seq: Sequence, budget: int) -> int:
        end = min(seq.num_prompt_tokens, seq.num_computed + budget)
        chunks.append(Chunk(seq, seq.num_computed, end))
        return end - seq.num_computed

    def finish(self, seq: Sequence, reason: FinishReason | None, now: float) -> None:
        """Take `seq` out of the batch and return its KV span; `reason` None: it failed."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.kv_start, seq.kv_tokens_needed)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.t_finished = now
