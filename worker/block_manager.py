"""Paged KV bookkeeping: blocks, block tables, reference counts and the prefix cache. No torch.

The KV cache (kv_cache.py) is a pool of `num_blocks` blocks of `block_size` token rows. A sequence
holds a block table: block i holds its tokens [i * block_size, (i + 1) * block_size). Blocks are
taken as a sequence grows and given back when it finishes, is cancelled or is preempted (once no
step in flight may still write them: scheduler.py), so memory follows the tokens that exist, not a
request's worst case.

Prefix caching, as in vLLM v1 and nano-vllm: a block that is full and whose tokens are all computed
gets a key chained over its parent's key and its own token ids, so a key names the whole prefix up
to the end of the block, not just the block. A new sequence walks its full blocks' keys and reuses
the longest chain found, taking a reference on each block; only the rest is prefilled. Keys are
16-byte BLAKE2b digests (vLLM hashes with sha256 by default for the same reason: a collision would
silently serve another prompt's keys and values); two distinct prefixes meeting by chance is a
2**-128 event per pair.

A block is in exactly one of three states:
- used: referenced by at least one block table (`ref_count` > 0);
- cached: unreferenced but still holding a keyed prefix, reusable until the pool needs it;
- free: unreferenced and holding nothing worth keeping.
New blocks come from the free ones first, then from the cached ones, least recently used first
(evicting its key). A sequence gives its blocks back last block first, so of one prompt the tail,
which fewer later requests share, is evicted before its head, as vLLM orders its free queue.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from worker.sequence import Sequence


@dataclass(eq=False, slots=True)
class Block:
    id: int
    ref_count: int = 0
    key: bytes | None = None  # its prefix-cache key, once full and computed (and first with that key)


@dataclass(slots=True)
class PrefixCacheCounters:
    """Monotonic totals, in tokens, over sequences' first admissions (a preempted sequence's
    readmission reuses its own blocks and would inflate the hit rate)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    prefix_caching: bool = True
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free: list[int] = list(reversed(range(self.num_blocks)))  # a stack: block 0 is taken first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed blocks, least recent first
        self._by_key: dict[bytes, Block] = {}  # every keyed block, used or cached
        self.num_used = 0

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks a sequence could take now: free, or cached and evictable."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- a sequence's life -------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        """Give `seq` (holding no blocks) a table covering `num_tokens` tokens, reusing the longest
        cached prefix of its tokens; set `seq.num_computed` to the tokens found. False, changing
        nothing, unless `reserve` blocks would still be available afterwards.

        At most `seq.num_tokens - 1` tokens come from the cache: the last token must run through
        the model for its logits, and writing it into a shared block could change another
        sequence's keys, so a prompt of exactly N full blocks reuses N - 1 of them."""
        assert not seq.block_table, "allocate: the sequence already holds blocks"
        hits = self._cached_prefix(seq)
        revived = sum(block.ref_count == 0 for block in hits)
        new = self.blocks_for(num_tokens) - len(hits)
        if self.num_available - revived - new < reserve:  # new >= 1: hits stop short of the last token
            return False
        for block in hits:
            self._take(block)
        seq.block_table = [block.id for block in hits]
        seq.block_table += (self._take(self._pop_available()).id for _ in range(new))
        seq.num_keyed_blocks = len(hits)
        seq.num_computed = len(hits) * self.block_size
        if seq.num_admissions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed
            self.counters.queries += seq.num_prompt_tokens
            self.counters.hits += seq.num_computed
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend `seq`'s table to cover `num_tokens` tokens; False, changing nothing, if the pool
        cannot."""
        new = self.blocks_for(num_tokens) - len(seq.block_table)
        if new <= 0:
            return True
        if new > self.num_available:
            return False
        seq.block_table += (self._take(self._pop_available()).id for _ in range(new))
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """Key the blocks of `seq` that are now full of computed, known tokens, so that later
        sequences can reuse them. A block whose key another block already holds stays private."""
        # Known tokens only: while steps overlap, the cache may already hold (or be about to hold)
        # rows for tokens not yet confirmed, and a key names token ids.
        full = min(min(seq.num_computed, seq.num_known_tokens) // self.block_size, len(seq.block_table))
        if not self.prefix_caching or full <= seq.num_keyed_blocks:  # most steps: no block filled up
            return
        self._extend_keys(seq, full)
        for i in range(seq.num_keyed_blocks, full):
            key = seq.block_keys[i]
            if key not in self._by_key:
                block = self.blocks[seq.block_table[i]]
                block.key = key
                self._by_key[key] = block
        seq.num_keyed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Give back every block of `seq`: a keyed block stays cached, the rest become free."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_used -= 1
                if block.key is None:
                    self._free.append(block_id)
                else:
                    self._cached[block_id] = None
        seq.block_table = []
        seq.num_keyed_blocks = 0

    # -- internals ---------------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[Block]:
        if not self.prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        self._extend_keys(seq, limit)
        hits: list[Block] = []
        for key in seq.block_keys[:limit]:
            block = self._by_key.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _extend_keys(self, seq: Sequence, num_blocks: int) -> None:
        """Compute `seq`'s chained block keys up to block `num_blocks` (its tokens must be known)."""
        keys, size = seq.block_keys, self.block_size
        for i in range(len(keys), num_blocks):
            digest = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
            digest.update(array("q", seq.tokens(i * size, (i + 1) * size)).tobytes())
            keys.append(digest.digest())

    def _pop_available(self) -> Block:
        if self._free:
            return self.blocks[self._free.pop()]
        block_id, _ = self._cached.popitem(last=False)  # evict the least recently used
        block = self.blocks[block_id]
        assert block.key is not None
        del self._by_key[block.key]
        block.key = None
        return block

    def _take(self, block: Block) -> Block:
        if block.ref_count == 0:
            self.num_used += 1
            self._cached.pop(block.id, None)  # a revived cache hit (no-op for a block just popped)
        block.ref_count += 1
        return block
