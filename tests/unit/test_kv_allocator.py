"""The KV arena's span allocator: first fit, merged on free, never over capacity, never overlapping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.kv_allocator import SpanAllocator


def test_first_fit_and_merge_on_free() -> None:
    kv = SpanAllocator(10)
    a, b, c = kv.allocate(3), kv.allocate(3), kv.allocate(3)
    assert (a, b, c) == (0, 3, 6)
    assert kv.allocate(2) is None
    kv.free(b, 3)
    assert kv.allocate(4) is None  # 3 + 1 free rows, not contiguous
    kv.free(a, 3)
    assert kv.allocate(6) == 0  # the freed neighbours merged
    kv.free(0, 6)
    kv.free(c, 3)
    assert kv.num_used == 0 and kv.allocate(10) == 0


def test_freeing_what_is_not_allocated_is_refused() -> None:
    kv = SpanAllocator(10)
    start = kv.allocate(4)
    assert start == 0
    with pytest.raises(ValueError):
        kv.free(6, 2)  # already free
    with pytest.raises(ValueError):
        kv.free(2, 4)  # overlaps the free tail


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=200))
def test_spans_never_overlap_or_exceed_capacity(ops: list[tuple[bool, int]]) -> None:
    capacity = 100
    kv = SpanAllocator(capacity)
    held: list[tuple[int, int]] = []
    for allocate, n in ops:
        if allocate or not held:
            start = kv.allocate(n)
            if start is None:
                assert not any(length >= n for length in kv._lengths)
                continue
            held.append((start, n))
        else:
            kv.free(*held.pop(n % len(held)))
        rows = sorted(held)
        assert all(s1 + n1 <= s2 for (s1, n1), (s2, _) in zip(rows, rows[1:], strict=False))
        assert all(0 <= s and s + n <= capacity for s, n in rows)
        assert kv.num_used == sum(n for _, n in held) <= capacity
    for span in held:
        kv.free(*span)
    assert kv.allocate(capacity) == 0
