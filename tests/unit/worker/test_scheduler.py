"""Continuous batching decisions, without a model: budgets, chunking, admission order, KV room."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from hypothesis import example, given
from hypothesis import strategies as st

from govwire.vocab import FinishReason
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import SamplingParams, Sequence, SequenceStatus


def seq(prompt_len: int, max_new: int = 4, name: str = "") -> Sequence:
    return Sequence(name, list(range(prompt_len)), max_new, SamplingParams(temperature=0.0), True, t_arrival=0.0)


@dataclass(frozen=True)
class Row:
    """A step's tokens [start, end) of `seq`: a decode row (one token) or a prompt chunk."""

    seq: Sequence
    start: int
    end: int
    samples: bool
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class Rows(list[Row]):
    step = 0


def schedule(s: Scheduler, now: float = 0.0) -> Rows:
    """The next step's rows, decode rows first."""
    planned = s.schedule(now)
    assert not planned.needs_drain
    step = planned.step
    rows = Rows()
    if step is None:
        return rows
    rows.step = step.step
    rows += [Row(x, p, p + 1, True, False) for x, p in zip(step.decode, step.positions, strict=True)]
    rows += [Row(c.seq, c.start, c.end, c.samples, True) for c in step.prefill]
    return rows


def run(s: Scheduler, rows: Rows) -> None:
    """What the engine does after a forward: the step is done, full blocks are offered to the
    prefix cache, a sampled token is confirmed (or its sequence has ended meanwhile), a sequence
    finishes at its length."""
    s.step_done(rows.step)
    for row in rows:
        if row.seq.status is SequenceStatus.RUNNING:
            s.blocks.cache_computed(row.seq)
        if row.samples:
            row.seq.num_pending -= 1
            if row.seq.status is not SequenceStatus.RUNNING:
                continue
            row.seq.output_ids.append(1)
            if len(row.seq.output_ids) == row.seq.max_new_tokens:
                s.finish(row.seq, FinishReason.LENGTH, 0.0)


def test_a_long_prompt_is_chunked_while_running_sequences_keep_decoding() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_prefill_tokens=10, kv_cache_tokens=1000))
    short = seq(5)
    s.add(short)
    run(s, schedule(s, 0.0))
    long = seq(25)
    s.add(long)
    steps = []
    for _ in range(3):
        chunks = schedule(s, 0.0)
        steps.append([(c.seq is short, c.start, c.end, c.samples) for c in chunks])
        run(s, chunks)
    assert steps == [
        [(True, 5, 6, True), (False, 0, 10, False)],
        [(True, 6, 7, True), (False, 10, 20, False)],
        [(True, 7, 8, True), (False, 20, 25, True)],
    ]
    assert long.output_ids == [1] and long.is_decoding


def test_a_short_prompt_arriving_during_a_long_prefill_starts_at_the_next_step() -> None:
    """New prompts take the prompt budget first; the prompt under way keeps at least half of it,
    so a stream of short prompts slows a long one down but never stops it."""
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_prefill_tokens=16, kv_cache_tokens=4000))
    long = seq(100, name="long")
    s.add(long)
    run(s, schedule(s, 0.0))
    assert long.num_computed == 16
    progress = []
    for i in range(4):
        s.add(seq(6, name=f"short{i}"))
        chunks = schedule(s, 0.0)
        by_name = {c.seq.request_id: (c.start, c.end) for c in chunks if c.seq.request_id in ("long", f"short{i}")}
        progress.append(by_name)
        run(s, chunks)
    assert [p[f"short{i}"] for i, p in enumerate(progress)] == [(0, 6)] * 4  # each whole, at once
    assert [p["long"][1] - p["long"][0] for p in progress] == [10] * 4  # the rest of the budget
    flood = [seq(16, name=f"big{i}") for i in range(3)]  # new prompts that would take it all
    for f in flood:
        s.add(f)
    before = long.num_computed
    run(s, schedule(s, 0.0))
    assert long.num_computed - before == 8  # half the budget, kept


def test_admissions_per_step_and_batch_size_are_capped() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=3, prefill_max_batch_size=2, max_prefill_tokens=100))
    for i in range(5):
        s.add(seq(4, name=str(i)))
    first = schedule(s, 0.0)
    assert [c.seq.request_id for c in first] == ["0", "1"]
    run(s, first)
    second = schedule(s, 0.0)
    assert [c.seq.request_id for c in second] == ["0", "1", "2"]  # two decodes, one admission: batch full
    assert len(s.running) == 3 and len(s.waiting) == 2


def test_worst_case_reservation_admits_on_whole_lives_and_the_head_blocks_those_behind_it() -> None:
    config = SchedulerConfig(max_batch_size=8, kv_cache_tokens=24, kv_block_size=4, kv_reservation="worst-case")
    s = Scheduler(config)
    a, big, small = seq(10, 5, "a"), seq(10, 8, "big"), seq(2, 2, "small")  # 14, 17, 3 tokens: 4, 5, 1 blocks
    for x in (a, big, small):
        s.add(x)
    run(s, schedule(s, 1.0))
    assert list(s.running) == [a] and list(s.waiting) == [big, small]  # small would fit, but is behind big
    assert s.blocks.num_used == 4
    s.finish(a, "length", 2.0)
    assert s.blocks.num_used == 0
    chunks = schedule(s, 3.0)
    assert [c.seq for c in chunks] == [big, small]
    assert big.t_admitted == 3.0 and big.block_table == [0, 1, 2, 3, 4] and small.block_table == [5]


def test_paged_admission_takes_the_prompt_blocks_and_grows_a_block_at_a_time() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, kv_cache_tokens=64, kv_block_size=4))
    a = seq(6, 10, "a")
    s.add(a)
    run(s, schedule(s, 0.0))
    assert a.block_table == [0, 1] and a.num_computed == 6 and a.output_ids == [1]
    run(s, schedule(s, 0.0))  # feeds token 6 into block 1
    assert a.block_table == [0, 1]
    run(s, schedule(s, 0.0))  # token 7 still in block 1; token 8 needs block 2
    run(s, schedule(s, 0.0))
    assert a.block_table == [0, 1, 2] and a.num_computed == 9


def test_when_the_pool_runs_dry_the_newest_sequence_is_preempted_and_keeps_its_tokens() -> None:
    config = SchedulerConfig(max_batch_size=8, kv_cache_tokens=16, kv_block_size=4, prefix_caching=False)
    s = Scheduler(config)  # 4 blocks
    old = seq(4, 8, "old")
    new = Sequence("new", [7, 7, 7, 7], 8, SamplingParams(temperature=0.0), True, t_arrival=0.0)
    s.add(old)
    run(s, schedule(s, 0.0))
    s.add(new)
    run(s, schedule(s, 0.0))  # old decodes token 4 into block 1; new is admitted into block 2
    assert old.block_table == [0, 1] and new.block_table == [2]
    run(s, schedule(s, 0.0))  # new's token 4 takes block 3: the pool is full
    assert s.blocks.num_available == 0 and s.num_preemptions == 0
    generated = list(new.output_ids)
    chunks = schedule(s, 0.0)  # old needs a block for token 8 after 3 more: not yet
    run(s, chunks)
    while s.num_preemptions == 0:
        chunks = schedule(s, 0.0)
        run(s, chunks)
    assert list(s.running) == [old] and list(s.waiting) == [new]  # the newest gave its blocks back
    assert new.block_table == [] and new.num_computed == 0 and new.output_ids[: len(generated)] == generated
    assert all(c.seq is old for c in chunks)  # nothing admitted in a step that preempted
    chunks = schedule(s, 0.0)
    while new not in [c.seq for c in chunks]:
        run(s, chunks)
        chunks = schedule(s, 0.0)
    # Readmitted: prompt + generated tokens again, then the next token is sampled.
    (chunk,) = [c for c in chunks if c.seq is new]
    assert (chunk.start, chunk.end, chunk.samples, chunk.is_prefill) == (0, new.num_known_tokens, True, True)
    assert new.num_admissions == 2 and new.output_ids[: len(generated)] == generated


def test_a_cached_prefix_is_not_prefilled_again_but_the_last_token_always_is() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, kv_cache_tokens=64, kv_block_size=4))
    first = Sequence("1", list(range(10)), 2, SamplingParams(temperature=0.0), True, t_arrival=0.0)
    s.add(first)
    run(s, schedule(s, 0.0))
    same = Sequence("2", list(range(10)), 2, SamplingParams(temperature=0.0), True, t_arrival=0.0)
    exact = Sequence("3", list(range(8)), 2, SamplingParams(temperature=0.0), True, t_arrival=0.0)
    s.add(same)
    s.add(exact)
    chunks = {c.seq.request_id: (c.start, c.end) for c in schedule(s, 0.0)}
    assert chunks["2"] == (8, 10) and same.block_table[:2] == first.block_table[:2]
    assert chunks["3"] == (4, 8)  # two full blocks cached, but the last token's block is computed again
    assert same.num_cached_prompt_tokens == 8 and exact.num_cached_prompt_tokens == 4
    assert s.blocks.counters.queries == 28 and s.blocks.counters.hits == 12


def test_finishing_a_waiting_request_drops_it_from_the_queue() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=1))
    a, b = seq(3), seq(3)
    s.add(a)
    s.add(b)
    schedule(s, 0.0)
    s.finish(b, "cancelled", 1.0)
    assert not s.waiting and b.status is SequenceStatus.FINISHED and b.finish_reason == "cancelled"


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=30), st.integers(1, 12)), min_size=1, max_size=25
    ),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 40),
    st.integers(0, 8),
    st.integers(1, 8),
    st.sampled_from(["paged", "worst-case"]),
    st.booleans(),
    st.integers(0, 2**16),
)
# Found by the property: one decode a step (max_batch 1) among six running, the chosen one the
# newest, the older ones holding every block: it preempted itself and the step was empty.
@example(
    [([0], 1), ([0] * 11, 2), ([0], 4), ([0] * 5, 6), ([0], 3), ([0], 2), ([0], 2), ([0] * 4, 5), ([0] * 29, 3)],
    1, 1, 10, 6, 2, "paged", False, 0,
)  # fmt: skip
# And, against a first fix: a decode chosen early, preempted by a later one's room-making, must
# not keep its chunk.
@example(
    [([0], 5), ([0], 5), ([0] * 10, 4), ([0] * 6, 3), ([0] * 12, 2)], 4, 2, 14, 5, 3, "paged", False, 0
)  # fmt: skip
def test_every_request_finishes_within_every_budget(
    requests: list[tuple[list[int], int]],
    max_batch: int,
    max_admit: int,
    prefill_budget: int,
    max_running: int,
    block_size: int,
    reservation: Literal["paged", "worst-case"],
    prefix_caching: bool,
    cancel_seed: int,
) -> None:
    # Prompts of two token ids share prefixes often. Every request fits alone: 30 + 12 - 1 tokens.
    config = SchedulerConfig(
        max_batch, max_admit, prefill_budget, 48, max_running, block_size, prefix_caching, reservation
    )
    s = Scheduler(config)
    seqs = [Sequence(str(i), p, n, SamplingParams(temperature=0.0), True, 0.0) for i, (p, n) in enumerate(requests)]
    for x in seqs:
        s.add(x)
    for step in range(10_000):
        if not s.has_work:
            break
        chunks = schedule(s, float(step))
        assert chunks, "work remains but nothing was scheduled"
        assert len({id(c.seq) for c in chunks}) == len(chunks)
        assert sum(not c.is_prefill for c in chunks) <= max_batch
        assert len(s.running) <= (max_running or max_batch)
        assert sum(c.num_tokens for c in chunks if c.is_prefill) <= prefill_budget
        assert all(c.end == c.seq.num_computed and len(c.seq.block_table) * block_size >= c.end for c in chunks)
        held = Counter(b for x in s.running for b in x.block_table)
        assert s.blocks.num_used == len(held) <= config.num_blocks
        assert all(s.blocks.blocks[b].ref_count == n and (n == 1 or s.blocks.blocks[b].key) for b, n in held.items())
        assert s.blocks.num_used + s.blocks.num_cached + s.blocks.num_free == config.num_blocks
        run(s, chunks)
        for x in list(s.running):
            if (cancel_seed + step + len(x.output_ids)) % 17 == 0:
                s.finish(x, FinishReason.CANCELLED, float(step))
    assert not s.has_work and s.blocks.num_used == 0
    assert all(x.status is SequenceStatus.FINISHED for x in seqs)
    assert reservation == "paged" or s.num_preemptions == 0


def test_above_the_decode_batch_running_sequences_take_turns_oldest_turn_first() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_running=4, prefill_max_batch_size=4, max_prefill_tokens=100))
    seqs = [seq(3, 20, str(i)) for i in range(5)]
    for x in seqs:
        s.add(x)
    first = schedule(s, 0.0)
    assert [c.seq.request_id for c in first] == ["0", "1", "2", "3"]  # four admitted and prefilled at once
    run(s, first)
    turns = []
    for _ in range(4):
        chunks = schedule(s, 0.0)
        turns.append([c.seq.request_id for c in chunks])
        run(s, chunks)
    assert turns == [["0", "1"], ["2", "3"], ["0", "1"], ["2", "3"]]
    assert len(s.running) == 4 and list(s.waiting) == [seqs[4]]


def test_a_whole_batch_finishing_in_one_step_gives_back_every_block_and_slot() -> None:
    config = SchedulerConfig(max_batch_size=64, prefill_max_batch_size=64, max_prefill_tokens=4096, kv_block_size=4)
    s = Scheduler(config)
    batch = [seq(5, 3, str(i)) for i in range(64)]
    for x in batch:
        s.add(x)
    slots = set()
    for _ in range(3):
        rows = schedule(s)
        slots |= {row.seq.slot for row in rows}
        run(s, rows)  # the third step finishes all 64 at their length
    assert slots == set(range(64)) and not s.running and s.blocks.num_used == 0
    later = seq(5, 3, "later")
    s.add(later)
    run(s, schedule(s))
    assert later.slot in slots and s.tables[later.slot, : len(later.block_table)].tolist() == later.block_table


def test_a_sequence_that_ends_while_a_step_is_in_flight_keeps_its_blocks_until_that_step_is_done() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=4, kv_block_size=4))
    a = seq(5, 10, "a")
    s.add(a)
    first = schedule(s)  # its prefill, in flight
    second = schedule(s)  # its first decode, planned before the prefill's token is known
    assert [r.seq for r in second] == [a] and a.num_pending == 2
    s.finish(a, FinishReason.CANCELLED, 0.0)
    assert a.block_table and s.blocks.num_used == 2  # both steps may still write them
    s.step_done(first.step)
    assert a.block_table and s.blocks.num_used == 2
    s.step_done(second.step)
    assert not a.block_table and s.blocks.num_used == 0 and a.slot == -1


def test_prompts_take_the_whole_budget_while_nothing_decodes_and_the_learned_one_beside_streams() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, max_prefill_tokens=1000, kv_cache_tokens=4000))
    s.prefill_while_decoding = 20
    first = seq(300, 8, "first")
    s.add(first)
    rows = schedule(s)
    assert [(r.start, r.end) for r in rows] == [(0, 300)]  # nothing decodes: all of it at once
    run(s, rows)
    second = Sequence("second", [7] * 300, 8, SamplingParams(temperature=0.0), True, t_arrival=0.0)
    s.add(second)
    rows = schedule(s)
    assert [(r.seq.request_id, r.end - r.start) for r in rows] == [("first", 1), ("second", 20)]
