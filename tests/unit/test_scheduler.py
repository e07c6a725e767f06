"""Continuous batching decisions, without a model: budgets, chunking, admission order, KV room."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.scheduler import Chunk, Scheduler, SchedulerConfig
from worker.sequence import SamplingParams, Sequence, SequenceStatus


def seq(prompt_len: int, max_new: int = 4, name: str = "") -> Sequence:
    return Sequence(name, list(range(prompt_len)), max_new, SamplingParams(temperature=0.0), True, t_arrival=0.0)


def run(chunks: list[Chunk]) -> None:
    """What the engine does after a forward: advance the cache, append a token where one was sampled."""
    for chunk in chunks:
        chunk.seq.num_computed = chunk.end
        if chunk.samples:
            chunk.seq.output_ids.append(1)


def test_a_long_prompt_is_chunked_while_running_sequences_keep_decoding() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_prefill_tokens=10, kv_cache_tokens=1000))
    short = seq(5)
    s.add(short)
    run(s.schedule(0.0))
    long = seq(25)
    s.add(long)
    steps = []
    for _ in range(3):
        chunks = s.schedule(0.0)
        steps.append([(c.seq is short, c.start, c.end, c.samples) for c in chunks])
        run(chunks)
    assert steps == [
        [(True, 5, 6, True), (False, 0, 10, False)],
        [(True, 6, 7, True), (False, 10, 20, False)],
        [(True, 7, 8, True), (False, 20, 25, True)],
    ]
    assert long.output_ids == [1] and not long.is_prefilling


def test_admissions_per_step_and_batch_size_are_capped() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=3, prefill_max_batch_size=2, max_prefill_tokens=100))
    for i in range(5):
        s.add(seq(4, name=str(i)))
    first = s.schedule(0.0)
    assert [c.seq.request_id for c in first] == ["0", "1"]
    run(first)
    second = s.schedule(0.0)
    assert [c.seq.request_id for c in second] == ["0", "1", "2"]  # two decodes, one admission: batch full
    assert len(s.running) == 3 and len(s.waiting) == 2


def test_the_head_request_waits_for_kv_room_and_blocks_those_behind_it() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, kv_cache_tokens=20))
    a, big, small = seq(10, 5, "a"), seq(10, 8, "big"), seq(2, 2, "small")
    for x in (a, big, small):
        s.add(x)
    run(s.schedule(1.0))
    assert s.running == [a] and list(s.waiting) == [big, small]  # small would fit, but is behind big
    s.finish(a, "length", 2.0)
    assert s.kv.num_used == 0
    chunks = s.schedule(3.0)
    assert [c.seq for c in chunks] == [big, small]
    assert big.t_admitted == 3.0 and big.kv_start == 0 and small.kv_start == 17


def test_finishing_a_waiting_request_drops_it_from_the_queue() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=1))
    a, b = seq(3), seq(3)
    s.add(a)
    s.add(b)
    s.schedule(0.0)
    s.finish(b, "cancelled", 1.0)
    assert not s.waiting and b.status is SequenceStatus.FINISHED and b.finish_reason == "cancelled"


@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=25),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 40),
    st.integers(0, 8),
    st.integers(0, 2**16),
)
def test_every_request_finishes_within_every_budget(
    requests: list[tuple[int, int]],
    max_batch: int,
    max_admit: int,
    prefill_budget: int,
    max_running: int,
    cancel_seed: int,
) -> None:
    capacity = 45  # every request fits alone: 30 + 12 - 1
    s = Scheduler(SchedulerConfig(max_batch, max_admit, prefill_budget, capacity, max_running))
    seqs = [seq(p, n, str(i)) for i, (p, n) in enumerate(requests)]
    for x in seqs:
        s.add(x)
    for step in range(10_000):
        if not s.has_work:
            break
        chunks = s.schedule(float(step))
        assert chunks, "work remains but nothing was scheduled"
        assert len({id(c.seq) for c in chunks}) == len(chunks)
        assert sum(not c.is_prefill for c in chunks) <= max_batch
        assert len(s.running) <= (max_running or max_batch)
        assert sum(c.num_tokens for c in chunks if c.is_prefill) <= prefill_budget
        assert s.kv.num_used == sum(x.kv_tokens_needed for x in s.running) <= capacity
        run(chunks)
        for x in list(s.running):
            if len(x.output_ids) == x.max_new_tokens:
                s.finish(x, "length", float(step))
            elif (cancel_seed + step + len(x.output_ids)) % 17 == 0:
                s.finish(x, "cancelled", float(step))
    assert not s.has_work and s.kv.num_used == 0
    assert all(x.status is SequenceStatus.FINISHED for x in seqs)


def test_above_the_decode_batch_running_sequences_take_turns_oldest_turn_first() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_running=4, prefill_max_batch_size=4, max_prefill_tokens=100))
    seqs = [seq(3, 20, str(i)) for i in range(5)]
    for x in seqs:
        s.add(x)
    first = s.schedule(0.0)
    assert [c.seq.request_id for c in first] == ["0", "1", "2", "3"]  # four admitted and prefilled at once
    run(first)
    turns = []
    for _ in range(4):
        chunks = s.schedule(0.0)
        turns.append([c.seq.request_id for c in chunks])
        run(chunks)
    assert turns == [["0", "1"], ["2", "3"], ["0", "1"], ["2", "3"]]
    assert len(s.running) == 4 and list(s.waiting) == [seqs[4]]
