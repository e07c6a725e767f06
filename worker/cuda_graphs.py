"""Decode steps replayed from CUDA graphs captured at start, so a step is not bound by launches.

An eager GPT-2 small decode step issues hundreds of small kernels, each launched from Python; on a
GPU the launches, not the maths, set the step time. Captured once, a step is one `replay()`.

As in nano-vllm's model runner: static input buffers, a graph per batch bucket (1, 2, 4, 8, then
every 16 up to the decode batch), captured largest first into one shared memory pool; a step of
n sequences replays the smallest bucket >= n with the rows past n padded. Attention here pads to
a context bucket too (64, 128, ... up to the model's context), because its width must be fixed at
capture (attention.GatherDecode), so there is a graph per (batch, context) bucket: 30 for a decode
batch of 32 and GPT-2's 1,024 positions. Block tables are a static [batch, blocks for the whole
context] buffer; a step copies its tables into the top-left corner, and every other entry holds
the scratch block (a narrower step clears the columns a wider one left); within a step's width,
columns past a row's length are gathered and masked out (attention.GatherDecode). The rows' input
ids are gathered inside the graph from the runner's token buffer by slot (runner.py), so a step
can be replayed before the host knows the tokens it feeds. Padding rows feed the scratch slot's
token at position 0, write their keys and values to the arena's scratch block and attend to its
first row alone, so they touch no sequence's cache.

Only pure-decode steps replay (every row a single token); a step with prompt chunks runs eagerly,
which is also where first tokens are sampled. Sampling stays outside the graph (sampling.py).

`capture` is injectable: on CUDA it records a `torch.cuda.CUDAGraph`; the CPU tests pass one that
returns the function itself, so the buffers, padding and bucket choice run, and are checked
against the eager path, on machines without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from worker.attention import GatherDecode
from worker.kv_cache import KVCache
from worker.model import GPT2, PackedBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

Replay = Callable[[], object]


class Capture(Protocol):
    def __call__(self, forward: Callable[[], None]) -> Replay: ...


class CudaGraphCapture:
    """Records `forward` into a CUDA graph; every graph shares the first one's memory pool."""

    def __init__(self) -> None:
        self._pool: _POOL_HANDLE | None = None  # the first graph's memory pool

    def __call__(self, forward: Callable[[], None]) -> Replay:
        forward()  # warm-up outside the capture: lazily initialised kernels and handles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            forward()
        if self._pool is None:
            self._pool = graph.pool()
        return graph.replay


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return [*buckets, max_batch]


def context_buckets(max_context: int) -> list[int]:
    buckets, width = [], 64
    while width < max_context:
        buckets.append(width)
        width *= 2
    return [*buckets, max_context]


class DecodeGraphs:
    def __init__(self, model: GPT2, cache: KVCache, token_buf: Tensor, max_batch: int, capture: Capture) -> None:
        """`token_buf`: the runner's last sampled token by slot; its last entry is scratch."""
        self.model = model
        self.cache = cache
        self.token_buf = token_buf
        self.scale = model.shape.head_dim**-0.5
        self.batch_buckets = batch_buckets(max_batch)
        self.context_buckets = context_buckets(model.shape.n_positions)
        device = cache.keys.device
        size = self.batch_buckets[-1]
        block_size = self.block_size = cache.block_size
        max_blocks = -(-model.shape.n_positions // block_size)
        # The static inputs, padding values everywhere until a step fills its first rows.
        self.scratch_slot = token_buf.numel() - 1
        self.token_slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), cache.scratch_block * block_size, dtype=torch.long, device=device)
        self.tables = torch.full((size, max_blocks), cache.scratch_block, dtype=torch.long, device=device)
        self.lens = torch.ones(size, dtype=torch.long, device=device)
        self.rows = torch.arange(size, device=device)
        self.width = max_blocks  # columns a step may have written: all, before the first
        self.logits = torch.empty(size, model.shape.vocab_size, dtype=cache.keys.dtype, device=device)
        started = time.perf_counter()
        self.graphs: dict[tuple[int, int], Replay] = {}
        for batch in reversed(self.batch_buckets):  # largest first: later graphs fit in its pool
            for width in reversed(self.context_buckets):
                self.graphs[batch, width] = capture(partial(self._forward, batch, width))
        self.capture_seconds = time.perf_counter() - started

    def _forward(self, batch: int, width: int) -> None:
        decode = GatherDecode(
            self.rows[:batch], self.tables[:batch], self.lens[:batch], width, self.block_size, self.scale
        )
        input_ids = self.token_buf.index_select(0, self.token_slots[:batch])
        packed = PackedBatch(input_ids, self.positions[:batch], self.slots[:batch], decode, [], None, None)
        self.logits[:batch] = self.model(packed, self.cache)

    def bucket(self, n: int, max_len: int) -> tuple[int, int] | None:
        """The graph for n decode rows whose longest span is max_len; None past the largest."""
        batch = next((b for b in self.batch_buckets if b >= n), None)
        width = next((w for w in self.context_buckets if w >= max_len), None)
        return None if batch is None or width is None else (batch, width)

    def run(
        self,
        bucket: tuple[int, int],
        token_slots: Tensor,
        positions: Tensor,
        slots: Tensor,
        tables: Tensor,
        lens: Tensor,
    ) -> Tensor:
        """Replay the bucket's graph for these n rows (device tensors [n], tables [n, W]); logits [n, V]."""
        n, (batch, _) = token_slots.numel(), bucket
        width = tables.shape[1]
        self.token_slots[:n] = token_slots
        self.positions[:n] = positions
        self.slots[:n] = slots
        self.tables[:n, :width] = tables
        if width < self.width:  # columns a wider step left
            self.tables[:, width : self.width] = self.cache.scratch_block
        self.width = width
        self.lens[:n] = lens
        self._pad(n, batch)  # rows a larger earlier step left behind
        self.graphs[bucket]()
        return self.logits[:n]

    def _pad(self, start: int, end: int) -> None:
        if start < end:
            scratch = self.cache.scratch_block
            self.token_slots[start:end] = self.scratch_slot
            self.positions[start:end] = 0
            self.slots[start:end] = scratch * self.block_size
            self.tables[start:end] = scratch
            self.lens[start:end] = 1
