"""Continuous batching: who runs in the next forward pass. No torch, so it is unit-tested alone.

Every step is one forward over a packed batch: one token for each running sequence that is
decoding, plus prompt chunks of sequences that are prefilling. Prefill and decode share the
forward (the weights are read once for both, and on CPU a larger matrix multiply is more
efficient), while `max_prefill_tokens` caps the prompt tokens per step so that a long prompt
delays the running sequences' next token by a bounded amount: a longer prompt is split into
chunks over several steps (Sarathi-Serve's stall-free batching). New prompts take the budget before
prompts already under way, which keep at least half of it: a short request arriving during a long
prompt's prefill starts at the next step, and the long prompt still advances every step. Sequences
join at any step boundary and leave the moment they finish.

Three knobs shape a step, after the token budget:
- `max_batch_size` is the decode batch: most decoding sequences per step (a sequence whose
  prefill completes in the step samples its first token too, outside this count);
- `max_running` (default: `max_batch_size`) bounds the admitted sequences, those holding a KV span.
  Above the decode batch, running sequences take turns, the one whose last turn is oldest first:
  requests get their first token sooner and each later token later (TTFT bought with TPOT);
- `prefill_max_batch_size` bounds admissions per step: how fast a burst moves from waiting into
  prefill, independently of the decode batch.

The KV cache is paged (block_manager.py). Admission is FIFO and needs room in the running set, a
free admission this step, and the blocks the sequence needs now: its prompt, less what the prefix
cache holds, plus a watermark of 1% of the pool while others run, so that running sequences can
still grow. A head request that does not fit blocks those behind it, so a large request is not
starved by a stream of small ones; while it waits, its wait is queue wait.

A decoding sequence takes a new block every `kv_block_size` tokens. When none is left, the most
recently admitted running sequence is preempted (vLLM's and nano-vllm's choice): it gives all its
blocks back and goes to the front of the waiting queue with the tokens it has generated; readmitted,
it prefills prompt + generated tokens again (reusing whatever of them is still cached) and samples
its next token, so its stream goes on without a gap or a repeat. Nothing is admitted in a step
that preempted. With `kv_reservation="worst-case"` a sequence takes the blocks for its whole life
(prompt + max_new_tokens - 1) at admission instead, and is never preempted: fewer run at once, but
no stream ever stalls for a recompute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from govwire.vocab import FinishReason
from worker.block_manager import BlockManager
from worker.sequence import Sequence, SequenceStatus

WATERMARK = 0.01  # of the pool's blocks, kept free at admission while others run (vLLM's default)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 32
    prefill_max_batch_size: int = 32
    max_prefill_tokens: int = 2048
    kv_cache_tokens: int = 32768
    max_running: int = 0  # 0 = max_batch_size
    kv_block_size: int = 16
    prefix_caching: bool = True
    kv_reservation: Literal["paged", "worst-case"] = "paged"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "prefill_max_batch_size", "max_prefill_tokens", "kv_block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_running < 0:
            raise ValueError("max_running must be >= 0")
        if self.kv_cache_tokens < self.kv_block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.kv_reservation not in ("paged", "worst-case"):
            raise ValueError("kv_reservation must be 'paged' or 'worst-case'")

    @property
    def running_cap(self) -> int:
        return self.max_running or self.max_batch_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool: the budget in whole blocks."""
        return self.kv_cache_tokens // self.kv_block_size


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [start, end) of `seq` go through the model this step; `samples` if a token follows.
    `is_prefill`: prompt tokens (or a preempted sequence's tokens again), under the prefill budget;
    else one fed-back token, under the decode batch."""

    seq: Sequence
    start: int
    end: int
    is_prefill: bool

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.kv_block_size, config.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission: the last is preempted first
        self.num_preemptions = 0
        self._watermark = int(WATERMARK * config.num_blocks)
        self._worst_case = config.kv_reservation == "worst-case"
        self._steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fits_ever(self, seq: Sequence) -> bool:
        """Whether the pool, all to itself, holds `seq` at its longest."""
        return self.blocks.blocks_for(seq.max_kv_tokens) <= self.config.num_blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float) -> list[Chunk]:
        """The next step's chunks: decodes first, then prompt chunks up to the prefill budget (new
        prompts before those under way, which keep half of it)."""
        config = self.config
        self._steps += 1
        decoding = [seq for seq in self.running if not seq.is_prefilling]
        if len(decoding) > config.max_batch_size:
            # Least recently stepped first; all of them, not only max_batch_size: one that makes
            # room by preempting itself (the newest, while older ones not stepped this time hold
            # the blocks) gives its place to the next, so a step never stalls with work left.
            decoding.sort(key=lambda seq: seq.last_step)
        preemptions = self.num_preemptions
        chosen: list[Sequence] = []
        for seq in decoding:
            if len(chosen) >= config.max_batch_size and _running(chosen) >= config.max_batch_size:
                break
            if seq.status is SequenceStatus.RUNNING:  # else preempted for an older one this step
                self._make_room(seq, seq.num_computed + 1)  # which may preempt one chosen before it
                if seq.status is SequenceStatus.RUNNING:
                    chosen.append(seq)
        chunks = [
            Chunk(seq, seq.num_computed, seq.num_tokens, False)
            for seq in chosen
            if seq.status is SequenceStatus.RUNNING
        ]
        # The prompt budget: new prompts first, so a short request that arrives while a long
        # prompt is being prefilled starts at the next step instead of after the long one's last
        # chunk; but prompts already under way keep at least half of it, so a stream of new ones
        # cannot starve them.
        budget = config.max_prefill_tokens
        underway = [seq for seq in self.running if seq.is_prefilling]
        kept = min(max(1, budget // 2), sum(seq.num_tokens - seq.num_computed for seq in underway))
        budget -= kept
        admitted = 0
        waiting = self.waiting
        while (
            budget
            and waiting
            and admitted < config.prefill_max_batch_size
            and len(self.running) < config.running_cap
            and self.num_preemptions == preemptions
        ):
            seq = waiting[0]
            need = seq.max_kv_tokens if self._worst_case else seq.num_tokens
            if not self.blocks.allocate(seq, need, self._watermark if self.running else 0):
                break
            waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_admissions += 1
            if seq.t_admitted is None:
                seq.t_admitted = now
            self.running.append(seq)
            admitted += 1
            budget -= self._add_prefill_chunk(chunks, seq, budget)
        budget += kept
        for seq in underway:
            if budget:
                budget -= self._add_prefill_chunk(chunks, seq, budget)
        for chunk in chunks:
            chunk.seq.last_step = self._steps
        return chunks

    def _make_room(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s table to `num_tokens`, preempting the most recently admitted sequences
        (maybe `seq` itself) until it fits."""
        while not self.blocks.grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _add_prefill_chunk(chunks: list[Chunk], seq: Sequence, budget: int) -> int:
        end = min(seq.num_tokens, seq.num_computed + budget)
        chunks.append(Chunk(seq, seq.num_computed, end, True))
        return end - seq.num_computed

    def computed(self, seq: Sequence, end: int) -> None:
        """After a step: `seq`'s tokens up to `end` are in the cache (and its full blocks cached)."""
        seq.num_computed = end
        self.blocks.cache_computed(seq)

    def finish(self, seq: Sequence, reason: FinishReason | None, now: float) -> None:
        """Take `seq` out of the batch and return its blocks; `reason` None: it failed."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.t_finished = now


def _running(seqs: list[Sequence]) -> int:
    return sum(seq.status is SequenceStatus.RUNNING for seq in seqs)
