"""The KV arena: keys and values of every cached token, allocated once at start-up.

Layout [layer][head, token row, head_dim], the rows grouped in blocks of `block_size`: block b is
rows [b * block_size, (b + 1) * block_size), a strided view [H, block_size, D] whose inner two
dimensions are contiguous, which attention reads without a copy. Blocks are handed out by
`block_manager.BlockManager`; nothing here grows, shrinks or is concatenated. One block past the
pool belongs to no sequence: the padding rows of a captured decode graph (cuda_graphs.py) write
their keys and values there.
"""

from __future__ import annotations

import torch

from worker.model_shape import GPT2Shape


class KVCache:
    def __init__(
        self, shape: GPT2Shape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        rows = (num_blocks + 1) * block_size
        storage = torch.zeros(2, shape.n_layer, shape.n_head, rows, shape.head_dim, dtype=dtype, device=device)
        self.keys = storage[0]  # [L, H, T, D]
        self.values = storage[1]
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.nbytes = storage.numel() * storage.element_size()
