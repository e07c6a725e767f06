"""The paged KV bookkeeping alone (no torch): block accounting, reference counts, the prefix cache."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worker.block_manager import BlockManager
from worker.sequence import SamplingParams, Sequence


def seq(tokens: list[int], max_new: int = 8, name: str = "") -> Sequence:
    return Sequence(name, list(tokens), max_new, SamplingParams(temperature=0.0), True, t_arrival=0.0)


def compute(bm: BlockManager, s: Sequence, end: int) -> None:
    s.num_computed = end
    bm.cache_computed(s)


def test_a_shared_prefix_is_reused_block_for_block_and_counted() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    assert bm.allocate(a, a.num_tokens) and a.block_table == [0, 1, 2] and a.num_computed == 0
    compute(bm, a, 10)
    b = seq([*range(8), 99, 98, 97])  # the same first 8 tokens, then its own
    assert bm.allocate(b, b.num_tokens)
    assert b.block_table[:2] == [0, 1] and b.block_table[2] not in a.block_table and b.num_computed == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    assert bm.counters.queries == 21 and bm.counters.hits == 8
    assert b.num_cached_prompt_tokens == 8


def test_a_chain_is_keyed_by_its_whole_prefix_not_its_last_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, a.num_tokens)
    compute(bm, a, 5)
    b = seq([9, 9, 3, 4, 5])  # block 1 holds the same tokens as a's block 1, after another parent
    bm.allocate(b, b.num_tokens)
    assert b.num_computed == 0 and set(b.block_table).isdisjoint(a.block_table)


def test_freed_prefixes_stay_cached_until_the_pool_needs_them_least_recent_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    old, recent = seq([1, 1, 1]), seq([2, 2, 2])
    for s in (old, recent):
        bm.allocate(s, s.num_tokens)
        compute(bm, s, 3)
        bm.free(s)
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 2, 2)  # each one full block kept
    filler = seq(list(range(10, 16)))  # three blocks: both free ones, then evicts `old`'s block
    bm.allocate(filler, filler.num_tokens)
    assert bm.num_cached == 1
    bm.free(filler)  # never computed: its blocks hold nothing worth keeping
    assert (bm.num_cached, bm.num_free) == (1, 3)
    again_old, again_recent = seq([1, 1, 1]), seq([2, 2, 2])
    assert bm.allocate(again_recent, 3) and bm.allocate(again_old, 3)
    assert again_recent.num_computed == 2 and again_old.num_computed == 0


def test_the_last_token_is_never_taken_from_the_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    bm.allocate(a, 8)
    compute(bm, a, 8)
    b = seq(list(range(8)))  # exactly two full blocks, both cached
    bm.allocate(b, 8)
    assert b.num_computed == 4 and b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(12)))
    assert bm.allocate(a, 12)
    b = seq(list(range(100, 108)))
    assert not bm.allocate(b, 8) and b.block_table == [] and bm.num_free == 1
    assert not bm.allocate(seq([5]), 1, reserve=1)  # the watermark
    assert not bm.grow(a, 20) and len(a.block_table) == 3
    assert bm.grow(a, 16) and len(a.block_table) == 4 and bm.num_available == 0


def test_without_prefix_caching_nothing_is_shared_or_kept() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    compute(bm, a, 5)
    b = seq([1, 2, 3, 4, 5])
    bm.allocate(b, 5)
    assert b.num_computed == 0 and set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached == 0 and bm.num_free == 8


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=24)  # three token ids: prefixes repeat


class BlockManagerMachine(RuleBasedStateMachine):
    """Any sequence of add / grow / compute / finish / preempt keeps the pool's books exact; eviction
    happens whenever an allocation needs more than the free blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=3)
        self.live: list[Sequence] = []

    @rule(tokens=TOKENS)
    def add(self, tokens: list[int]) -> None:
        s = seq(tokens, max_new=6)
        if self.bm.allocate(s, s.num_tokens, reserve=1 if self.live else 0):
            s.num_admissions += 1
            self.live.append(s)
        else:
            assert s.block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Compute some of a sequence's missing tokens; once all are, it generates one more."""
        s = data.draw(st.sampled_from(self.live))
        if s.num_computed < s.num_tokens:
            compute(self.bm, s, data.draw(st.integers(s.num_computed + 1, s.num_tokens)))
        elif self.bm.grow(s, s.num_tokens + 1):
            s.output_ids.append(data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.live))
        self.bm.free(s)
        self.live.remove(s)

    @precondition(lambda self: self.live)
    @rule()
    def preempt_and_readmit(self) -> None:
        """The newest gives its blocks back and asks for them again: its own full blocks are hits."""
        s = self.live.pop()
        self.bm.free(s)
        s.num_computed = 0
        if self.bm.allocate(s, s.num_tokens):
            self.live.append(s)
            assert s.num_computed <= s.num_tokens - 1

    @invariant()
    def books_balance(self) -> None:
        bm = self.bm
        held = Counter(b for s in self.live for b in s.block_table)
        assert bm.num_used + bm.num_cached + bm.num_free == bm.num_blocks
        assert bm.num_used == len(held) == sum(block.ref_count > 0 for block in bm.blocks)
        for block in bm.blocks:
            assert block.ref_count == held[block.id]
            assert held[block.id] <= 1 or block.key is not None  # only a cached prefix is shared
        free, cached = set(bm._free), set(bm._cached)
        used = {b for b in held}
        assert len(free) == len(bm._free) and not (free & cached) and not (free & used) and not (cached & used)
        assert all(bm.blocks[b].key is not None for b in cached) and all(bm.blocks[b].key is None for b in free)
        assert all(bm._by_key[block.key] is block for block in bm.blocks if block.key is not None)

    @invariant()
    def tables_cover_their_tokens(self) -> None:
        for s in self.live:
            assert len(s.block_table) * self.bm.block_size >= max(s.num_tokens, s.num_computed)
            assert len(s.block_table) == len(set(s.block_table))

    @invariant()
    def a_cached_block_holds_what_its_key_says(self) -> None:
        """A block reused by key holds exactly that prefix: every holder has the same tokens up to it."""
        size = self.bm.block_size
        owners: dict[int, list[int]] = {}
        for s in self.live:
            for i, b in enumerate(s.block_table[: s.num_computed // size]):
                prefix = s.tokens(0, (i + 1) * size)
                assert owners.setdefault(b, prefix) == prefix


TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_a_long_soak_leaves_the_pool_as_it_started_apart_from_cached_blocks() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    live: list[Sequence] = []
    for i in range(2_000):
        s = seq([i % 7, i % 3, *range(i % 11)])
        if bm.allocate(s, s.num_tokens, reserve=2):
            compute(bm, s, s.num_tokens)
            live.append(s)
        if len(live) > 8 or i % 5 == 0:
            bm.free(live.pop(i % len(live)))
    for s in live:
        bm.free(s)
    assert bm.num_used == 0 and bm.num_cached + bm.num_free == 64
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_cached > 0  # prefixes kept for reuse, evictable
