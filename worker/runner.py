"""The only code that touches the device: builds a step's tensors, runs the model, samples.

A step's metadata (token ids, positions, arena slots, decode block tables, sampled rows and their
parameters) is gathered in host lists and reaches the device in one transfer: on CUDA through one
pinned staging buffer copied with `non_blocking=True` (torch's caching host allocator does not
hand the buffer out again before that copy has run); on the CPU the host tensors are used as they
are. The step's only synchronisation is the `.tolist()` of its sampled tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch import Tensor

from worker.attention import DecodeAttention, GatherDecode, KernelDecode, Segment
from worker.cuda_graphs import Capture, DecodeGraphs
from worker.kernels.decode_attention import cpu_decode_attention
from worker.kv_cache import KVCache
from worker.model import GPT2, PackedBatch
from worker.sampling import SampledRows, sample
from worker.scheduler import Chunk

log = logging.getLogger("worker.runner")


@dataclass
class _Plan:
    """One step as host lists, in packed-row order."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # the arena row each token's keys and values go to
    segments: list[Segment] = field(default_factory=list)  # prompt chunks of several tokens
    gather: list[int] = field(default_factory=list)  # arena rows of segments whose blocks are not consecutive
    sample_rows: list[int] = field(default_factory=list)  # last row of each sampling chunk
    decode_rows: list[int] = field(default_factory=list)  # single-token rows ...
    decode_tables: list[int] = field(default_factory=list)  # ... their block tables, [rows, width] row-major
    decode_lens: list[int] = field(default_factory=list)  # ... and context lengths, this token included
    decode_width: int = 0  # blocks per decode table (shorter ones padded with block 0, never read)
    drawn: list[int] = field(default_factory=list)  # which sampled rows draw (index into sample_rows)
    top_k: list[int] = field(default_factory=list)  # per drawn row
    temperature: list[float] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    uniform: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, chunks: list[Chunk], vocab_size: int, block_size: int) -> _Plan:
        plan = cls()
        tables: list[list[int]] = []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            table = seq.block_table
            row = len(plan.ids)
            plan.ids += seq.tokens(start, end)  # a decode step feeds the last sampled token
            plan.positions += range(start, end)
            blocks = -(-end // block_size)
            if end - start == 1:
                plan.slots.append(table[start // block_size] * block_size + start % block_size)
                plan.decode_rows.append(row)
                plan.decode_lens.append(end)
                tables.append(table[:blocks])
            else:
                plan.slots += arena_rows(table, block_size, start, end)
                first = table[0]
                if table[:blocks] == list(range(first, first + blocks)):
                    plan.segments.append(Segment(row, len(plan.ids), first * block_size, end))
                else:
                    plan.segments.append(Segment(row, len(plan.ids), -1, end, len(plan.gather)))
                    plan.gather += arena_rows(table, block_size, 0, end)
            if not chunk.samples:
                continue
            params = seq.sampling
            if not params.is_greedy:
                assert seq.rng is not None  # the engine gives every sampled sequence its generator
                plan.drawn.append(len(plan.sample_rows))
                plan.top_k.append(params.top_k if 0 < params.top_k < vocab_size else 0)
                plan.temperature.append(params.temperature)
                plan.top_p.append(params.top_p)
                plan.uniform.append(seq.rng.random())
            plan.sample_rows.append(len(plan.ids) - 1)
        width = plan.decode_width = max(map(len, tables), default=0)
        for table in tables:
            plan.decode_tables += table
            plan.decode_tables += [0] * (width - len(table))
        return plan

    @property
    def is_pure_decode(self) -> bool:
        """Every row a single token whose logits are sampled: what a decode graph computes."""
        return not self.segments and len(self.sample_rows) == len(self.ids)


def arena_rows(table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The arena rows of tokens [start, end) of the sequence whose blocks are `table`."""
    rows: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = table[b] * block_size - b * block_size  # + token index = arena row
        rows += range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size))
    return rows


class ModelRunner:
    def __init__(
        self, model: GPT2, num_blocks: int, block_size: int, max_batch_size: int, capture: Capture | None = None
    ) -> None:
        """A KV cache of `num_blocks` blocks of `block_size` tokens; `capture` records decode graphs
        (cuda_graphs.py), None runs every step eagerly."""
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.cache = KVCache(model.shape, num_blocks, block_size, param.dtype, param.device)
        self.scale = model.shape.head_dim**-0.5
        if self.device.type == "cuda":
            # cuDNN's attention builds an execution plan for every new shape (~40 ms on an H200, seen
            # as eager bfloat16 steps 8x slower than float32 ones), and a step's shapes follow its
            # batch and context, so in serving nearly every step is new: SDPA picks among flash,
            # memory-efficient and math instead, which need no plan (docs/benchmarks/sittings.md, 5).
            torch.backends.cuda.enable_cudnn_sdp(False)
        kernel = cpu_decode_attention() if self.device.type == "cpu" else None
        self.kernel = kernel if kernel is not None and self.dtype in kernel.dtypes else None
        self.graphs = None if capture is None else DecodeGraphs(model, self.cache, max_batch_size, capture)
        if self.graphs is not None:
            log.info(
                "event=decode_graphs_captured graphs=%d seconds=%.2f",
                len(self.graphs.graphs),
                self.graphs.capture_seconds,
            )

    def run(self, chunks: list[Chunk]) -> list[int]:
        """Run one step; return the sampled token of each chunk that `samples`, in chunk order."""
        plan = _Plan.of(chunks, self.model.shape.vocab_size, self.block_size)
        ints, floats = self._stage(
            [
                plan.ids,
                plan.positions,
                plan.slots,
                plan.gather,
                plan.sample_rows,
                plan.decode_rows,
                plan.decode_tables,
                plan.decode_lens,
                plan.drawn,
                plan.top_k,
            ],
            [plan.temperature, plan.top_p, plan.uniform],
        )
        input_ids, positions, slots, gather, sample_rows, decode_rows, decode_tables, decode_lens, drawn, top_k = ints
        temperature, top_p, uniform = floats
        tables = decode_tables.view(len(plan.decode_rows), plan.decode_width)
        bucket = None
        if self.graphs is not None and plan.is_pure_decode:
            bucket = self.graphs.bucket(len(plan.ids), max(plan.decode_lens))
        if bucket is not None:
            assert self.graphs is not None
            logits = self.graphs.run(bucket, input_ids, positions, slots, tables, decode_lens)
        else:
            decode = self._decode_attention(decode_rows, tables, decode_lens, max(plan.decode_lens, default=0))
            every_row = len(plan.sample_rows) == len(plan.ids)
            batch = PackedBatch(
                input_ids,
                positions,
                slots,
                decode,
                plan.segments,
                gather if plan.gather else None,
                None if every_row else sample_rows,
            )
            logits = self.model(batch, self.cache)
        if not plan.sample_rows:
            return []
        sampled = None
        if plan.drawn:
            sampled = SampledRows(
                drawn, temperature, top_k, top_p, uniform, max(plan.top_k), any(p < 1 for p in plan.top_p)
            )
        tokens: list[int] = sample(logits, sampled).tolist()
        return tokens

    def _decode_attention(self, rows: Tensor, tables: Tensor, lens: Tensor, max_len: int) -> DecodeAttention | None:
        if not max_len:
            return None
        if self.kernel is not None:
            return KernelDecode(self.kernel, rows, tables, lens, self.block_size, self.scale)
        return GatherDecode(rows, tables, lens, max_len, self.block_size, self.scale)

    def _stage(self, ints: list[list[int]], floats: list[list[float]]) -> tuple[list[Tensor], list[Tensor]]:
        """The lists as device tensors (int64 and float64 views of one buffer), in one transfer.
        The buffer is built the same way on every device, so the CPU tests run this code too."""
        flat_ints = torch.tensor(list(chain.from_iterable(ints)), dtype=torch.int64)
        flat_floats = torch.tensor(list(chain.from_iterable(floats)), dtype=torch.float64)
        split = 8 * flat_ints.numel()
        on_cpu = self.device.type == "cpu"
        host = torch.empty(split + 8 * flat_floats.numel(), dtype=torch.uint8, pin_memory=not on_cpu)
        host[:split].view(torch.int64).copy_(flat_ints)
        host[split:].view(torch.float64).copy_(flat_floats)
        staged = host if on_cpu else host.to(self.device, non_blocking=True)
        return _split(staged[:split].view(torch.int64), ints), _split(staged[split:].view(torch.float64), floats)


def _split(flat: Tensor, parts: list[list[int]] | list[list[float]]) -> list[Tensor]:
    return list(torch.split(flat, [len(part) for part in parts]))
