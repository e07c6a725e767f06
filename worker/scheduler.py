"""Continuous batching: who runs in the next forward pass. No torch, so it is unit-tested alone.

Every step is one forward over a packed batch: one token for each running sequence that is
decoding, plus prompt chunks of sequences that are prefilling. Prefill and decode share the
forward (the weights are read once for both, and on CPU a larger matrix multiply is more
efficient), while a budget caps the prompt tokens per step so that a long prompt delays the
running sequences' next token by a bounded amount: a longer prompt is split into chunks over
several steps (Sarathi-Serve's stall-free batching). The budget is `max_prefill_tokens` while
nothing decodes, and `prefill_while_decoding` (at most that) beside decoding sequences, which the
engine sets from its steps' timing (prefill_budget.py). New prompts take the budget before
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

The batch is persistent (vLLM's InputBatch, SGLang's request pool): an admitted sequence takes a
slot, a row of `tables` (numpy, the block table mirrored once per block added, not rebuilt per
step) and of the runner's device token buffer, where the token it sampled last waits to be fed
back. A steady decode step is then one short loop over the decoding sequences (a block check and
two counters each) and array operations in the runner: no per-row objects. A step returns the
decoding sequences with their slots and positions, and `Chunk`s for prompt chunks only.

Steps may overlap (engine.py): the scheduler plans step t+1 while step t runs, so a sequence
scheduled at t is scheduled again with its token still pending (the runner feeds it from the
device buffer), and its length stop is known here: one with `max_new_tokens` tokens confirmed or
pending is not scheduled. Blocks and slots of a sequence that ends while a step is in flight are
given back when that step is done (`step_done`), since it may still write them. A preemption
needs the victim's tokens confirmed: while a step is in flight, a step that would preempt is not
planned (`NEEDS_DRAIN`), and the engine completes the step in flight first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal

import numpy as np

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
    max_model_len: int = 0  # longest sequence in tokens (the model's context); 0 = the pool

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "prefill_max_batch_size", "max_prefill_tokens", "kv_block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_running < 0 or self.max_model_len < 0:
            raise ValueError("max_running and max_model_len must be >= 0")
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

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the persistent block table: a sequence never holds more."""
        longest = min(self.max_model_len or self.kv_cache_tokens, self.kv_cache_tokens)
        return -(-longest // self.kv_block_size)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt tokens [start, end) of `seq` (or a preempted sequence's tokens again) go through the
    model this step, under the prefill budget; `samples`: the chunk ends its prefill, and the
    step samples its first (next) token."""

    seq: Sequence
    start: int
    end: int
    samples: bool


@dataclass(slots=True)
class ScheduledStep:
    """One step's rows, decode rows first. A decode row feeds its sequence's last sampled token
    (from the runner's token buffer: it may still be in flight) at `positions[i]`."""

    step: int  # the scheduler's step number; `step_done(step)` once it has run
    decode: list[Sequence]
    slots: list[int]  # of the decode rows
    positions: list[int]  # of the decode rows
    prefill: list[Chunk] = field(default_factory=list)

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences this step samples a token for, in the order of its sampled rows."""
        return self.decode + [chunk.seq for chunk in self.prefill if chunk.samples]


@dataclass(frozen=True, slots=True)
class Schedule:
    """`Scheduler.schedule`'s answer: the step to launch, or why there is none. Nothing to run
    (`NOTHING`) and "this step would preempt while another is in flight, so complete that one and
    ask again" (`NEEDS_DRAIN`) are both "no step", but the caller must tell them apart; two named
    fields say so where a `ScheduledStep | None | "needs-drain"` union left it to a comparison
    with a string."""

    step: ScheduledStep | None = None  # None: no step now
    needs_drain: bool = False  # (step None) drain the step in flight, then schedule again


NOTHING: Final = Schedule()
"""`schedule`'s answer when nothing can run."""
NEEDS_DRAIN: Final = Schedule(needs_drain=True)
"""`schedule`'s answer when the step would preempt while another is in flight."""


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.kv_block_size, config.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # in order of admission: the last is preempted first
        self.num_preemptions = 0
        self._watermark = int(WATERMARK * config.num_blocks)
        self._worst_case = config.kv_reservation == "worst-case"
        self._steps = 0
        cap = config.running_cap
        # The persistent batch: a row per slot, written when a block is added.
        self.tables = np.zeros((cap, config.max_blocks_per_seq), dtype=np.int64)
        self._free_slots = list(reversed(range(cap)))  # a stack: slot 0 is taken first
        self._decoding: list[Sequence] = []  # running sequences that decode, in admission order
        self._prefilling: list[Sequence] = []  # running sequences with prompt tokens to go
        self._membership_changed = False  # rebuild the two lists above from `running`
        self.prefill_while_decoding = config.max_prefill_tokens  # the prompt budget beside decode rows
        self._in_flight: list[int] = []  # steps scheduled and not done, oldest first
        self._deferred: list[tuple[int, Sequence]] = []  # (step, sequence): released when it is done

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fits_ever(self, seq: Sequence) -> bool:
        """Whether the pool, all to itself, holds `seq` at its longest."""
        return self.blocks.blocks_for(seq.max_kv_tokens) <= min(self.config.num_blocks, self.tables.shape[1])

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float, may_preempt: bool = True) -> Schedule:
        """The next step: decodes first, then prompt chunks up to the prefill budget (new prompts
        before those under way, which keep half of it); `NOTHING` if nothing can run. Scheduling
        advances the sequences as if the step had run (`num_computed`, `num_pending`).
        `may_preempt` False: answer `NEEDS_DRAIN` instead of preempting."""
        preemptions = self.num_preemptions
        scheduled = self._schedule_decodes(self._steps + 1, may_preempt)
        if scheduled is None:
            return NEEDS_DRAIN
        preempted = self.num_preemptions != preemptions
        # The prompt budget: new prompts first, so a short request that arrives while a long
        # prompt is being prefilled starts at the next step instead of after the long one's last
        # chunk; but prompts already under way keep at least half of it, so a stream of new ones
        # cannot starve them.
        budget = self.config.max_prefill_tokens
        if scheduled.decode:
            budget = max(1, min(budget, self.prefill_while_decoding))
        if preempted:  # a victim may have been prefilling
            underway = [seq for seq in self.running if not seq.is_decoding]
        else:
            underway = list(self._prefilling)
        kept = min(max(1, budget // 2), sum(seq.num_tokens - seq.num_computed for seq in underway))
        budget -= kept
        if not preempted:  # nothing is admitted in a step that preempted
            budget = self._schedule_new_prompts(scheduled, budget, now)
        self._schedule_underway(scheduled, underway, budget + kept)
        if not scheduled.decode and not scheduled.prefill:
            return NOTHING
        self._steps = scheduled.step
        self._in_flight.append(scheduled.step)
        return Schedule(scheduled)

    def _schedule_decodes(self, step: int, may_preempt: bool) -> ScheduledStep | None:
        """The first phase: step `step` with a decode row for each decoding sequence it takes, up to
        the decode batch, each given a new block when its token crosses into one (which may preempt,
        or, `may_preempt` False, answer None instead)."""
        config = self.config
        if self._membership_changed:
            self._decoding = [seq for seq in self.running if seq.is_decoding]
            self._prefilling = [seq for seq in self.running if not seq.is_decoding]
            self._membership_changed = False
        decoding = self._decoding
        if len(decoding) > config.max_batch_size:
            # Least recently stepped first; all of them, not only max_batch_size: one that makes
            # room by preempting itself (the newest, while older ones not stepped this time hold
            # the blocks) gives its place to the next, so a step never stalls with work left.
            decoding = sorted(decoding, key=_last_step)
        preemptions = self.num_preemptions
        span = config.kv_block_size
        chosen: list[Sequence] = []
        for seq in decoding:
            if len(chosen) >= config.max_batch_size and _running(chosen) >= config.max_batch_size:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an older one this step
                continue
            if len(seq.output_ids) + seq.num_pending >= seq.max_new_tokens:
                continue  # its last token is in flight
            if seq.num_computed >= len(seq.block_table) * span:  # crosses into a new block
                if not may_preempt and not self._grows_without_preempting(seq):
                    return None
                self._make_room(seq, seq.num_computed + 1)  # which may preempt one chosen before it
                if seq.status is not SequenceStatus.RUNNING:
                    continue
            chosen.append(seq)
        if self.num_preemptions != preemptions:
            chosen = [seq for seq in chosen if seq.status is SequenceStatus.RUNNING]
        return self._decode_rows(step, chosen)

    def _decode_rows(self, step: int, chosen: list[Sequence]) -> ScheduledStep:
        """Step `step` with a decode row for each of `chosen`, each advanced by its pending token."""
        slots: list[int] = []
        positions: list[int] = []
        for seq in chosen:
            slots.append(seq.slot)
            positions.append(seq.num_computed)
            seq.num_computed += 1
            seq.num_pending += 1
            seq.last_step = step
        return ScheduledStep(step, chosen, slots, positions)

    def _schedule_new_prompts(self, scheduled: ScheduledStep, budget: int, now: float) -> int:
        """The second phase: admit waiting sequences in order (FIFO, the head blocking those behind
        it) while the step has room, each with its first chunk; the budget left."""
        config = self.config
        admitted = 0
        waiting = self.waiting
        while (
            budget
            and waiting
            and admitted < config.prefill_max_batch_size
            and len(self.running) < config.running_cap
            and self._free_slots
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
            seq.slot = self._free_slots.pop()
            self._write_table(seq, 0)
            self.running[seq] = None
            self._membership_changed = True
            admitted += 1
            budget -= self._add_prefill_chunk(scheduled, seq, budget)
        return budget

    def _schedule_underway(self, scheduled: ScheduledStep, underway: list[Sequence], budget: int) -> None:
        """The third phase: the next chunk of each prompt under way, in order, while budget is left."""
        for seq in underway:
            if not budget:
                break
            budget -= self._add_prefill_chunk(scheduled, seq, budget)

    def step_done(self, step: int) -> None:
        """Step `step` (and every earlier one) has run: what ended meanwhile gives back its blocks."""
        in_flight = self._in_flight
        while in_flight and in_flight[0] <= step:
            in_flight.pop(0)
        if self._deferred:
            kept = []
            for until, seq in self._deferred:
                if until <= step:
                    self._release(seq)
                else:
                    kept.append((until, seq))
            self._deferred = kept

    def _grows_without_preempting(self, seq: Sequence) -> bool:
        return self.blocks.blocks_for(seq.num_computed + 1) - len(seq.block_table) <= self.blocks.num_available

    def _make_room(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s table to `num_tokens`, preempting the most recently admitted sequences
        (maybe `seq` itself) until it fits."""
        held = len(seq.block_table)
        while not self.blocks.grow(seq, num_tokens):
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim is seq:
                return
        self._write_table(seq, held)

    def _preempt(self, seq: Sequence) -> None:
        assert not self._in_flight, "preempting while a step is in flight: its tokens are not confirmed"
        del self.running[seq]
        self._release(seq)
        seq.num_computed = 0
        seq.num_pending = 0
        seq.is_decoding = False
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._membership_changed = True

    def _write_table(self, seq: Sequence, start: int) -> None:
        """Mirror `seq`'s block table from column `start` into its slot's row."""
        table = seq.block_table
        self.tables[seq.slot, start : len(table)] = table[start:]

    def _add_prefill_chunk(self, scheduled: ScheduledStep, seq: Sequence, budget: int) -> int:
        start = seq.num_computed
        end = min(seq.num_tokens, start + budget)
        samples = end == seq.num_tokens
        scheduled.prefill.append(Chunk(seq, start, end, samples))
        seq.num_computed = end
        seq.last_step = scheduled.step
        if samples:
            seq.num_pending += 1
            seq.is_decoding = True
            self._membership_changed = True
        return end - start

    def finish(self, seq: Sequence, reason: FinishReason | None, now: float) -> None:
        """Take `seq` out of the batch and give back its blocks (once the steps in flight, which
        may still write them, are done); `reason` None: it failed."""
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq]
            self._membership_changed = True
            if self._in_flight:
                self._deferred.append((self._in_flight[-1], seq))
            else:
                self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.t_finished = now

    def abandon_in_flight(self) -> None:
        """Forget the steps in flight (they failed): give back what waited for them."""
        if self._in_flight:
            self.step_done(self._in_flight[-1])

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self._free_slots.append(seq.slot)
        seq.slot = -1


def _last_step(seq: Sequence) -> int:
    return seq.last_step


def _running(seqs: list[Sequence]) -> int:
    return sum(seq.status is SequenceStatus.RUNNING for seq in seqs)
