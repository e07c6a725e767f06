"""The KV arena: keys and values of every cached token, allocated once at start-up.

Layout [layer][head, token row, head_dim]: a sequence's span of rows is a strided view
[H, S, D] whose inner two dimensions are contiguous, which attention reads without a copy. Rows
are handed out by `kv_allocator.SpanAllocator`; nothing here grows, shrinks or is concatenated.
One row past the capacity belongs to no sequence: the padding rows of a captured decode graph
(cuda_graphs.py) write their keys and values there.
"""

from __future__ import annotations

import torch

from worker.model_shape import GPT2Shape


class KVCache:
    def __init__(self, shape: GPT2Shape, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        rows = capacity + 1
        storage = torch.zeros(2, shape.n_layer, shape.n_head, rows, shape.head_dim, dtype=dtype, device=device)
        self.keys = storage[0]  # [L, H, T, D]
        self.values = storage[1]
        self.scratch_row = capacity
        self.nbytes = storage.numel() * storage.element_size()
