"""Bookkeeping of the KV arena: which token rows belong to which sequence. No torch.

The KV cache is one preallocated arena of `capacity` token rows (see `kv_cache.py`). A sequence is
given one contiguous span, sized for its whole life (prompt + max_new_tokens - 1: the last sampled
token is never fed back), when it is admitted. Reserving the worst case up front means a running
sequence never has to be preempted or moved, and the budget can never be exceeded; early EOS or a
cancel returns the span at once. Spans are first-fit from an address-ordered free list, merged
with their neighbours when freed, so the arena does not fragment into unusable slivers for long.
"""

from __future__ import annotations

import bisect


class SpanAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.num_used = 0
        self._starts: list[int] = [0]  # free spans, ordered by start
        self._lengths: list[int] = [capacity]

    def allocate(self, length: int) -> int | None:
        """Reserve `length` contiguous rows; return the first row, or None if no free span fits."""
        if length <= 0:
            raise ValueError("length must be positive")
        for i, free in enumerate(self._lengths):
            if free >= length:
                start = self._starts[i]
                if free == length:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] = start + length
                    self._lengths[i] = free - length
                self.num_used += length
                return start
        return None

    def free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if (i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start) or (
            i < len(self._starts) and start + length > self._starts[i]
        ):
            raise ValueError(f"span [{start}, {start + length}) is not allocated")
        self.num_used -= length
        merge_prev = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_next = i < len(self._starts) and start + length == self._starts[i]
        if merge_prev and merge_next:
            self._lengths[i - 1] += length + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += length
        elif merge_next:
            self._starts[i] = start
            self._lengths[i] += length
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, length)
