"""The only code that touches the device: builds a step's tensors, runs the model, samples.

A step's metadata (positions, arena rows, decode block tables, sampled rows and their parameters)
is computed on the host with array operations over the scheduler's persistent batch (its block
table rows indexed by slot), and reaches the device in one transfer: on CUDA through one pinned
staging buffer copied with `non_blocking=True` (torch's caching host allocator does not hand the
buffer out again before that copy has run); on the CPU the host tensors are used as they are.

A decode row's input token is never on the host: every sampled token is written to a device
buffer at its sequence's slot (`token_buf`), and a decode row gathers its input from there, on
the device and inside the decode graph (SGLang's future map, vLLM's `prev_sampled_token_ids`).
So step t+1 can be launched before step t's tokens are read back (`launch` returns a handle;
`wait` reads them), which is how the engine overlaps its host work with the device's. How work
is put on the device is a `Launcher`: at once on the CPU (the CPU is the device); queued on a
CUDA stream with the tokens copied back without blocking; queued until waited for in the tests'
stand-in, so that everything a step needs from the one before really comes from the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from worker.attention import DecodeAttention, GatherDecode, KernelDecode, Segment
from worker.cuda_graphs import Capture, DecodeGraphs
from worker.kernels.decode_attention import cpu_decode_attention
from worker.kv_cache import KVCache
from worker.model import GPT2, PackedBatch
from worker.sampling import SampledRows, sample
from worker.scheduler import ScheduledStep, SchedulerConfig

log = logging.getLogger("worker.runner")

_EMPTY = np.zeros(0, dtype=np.int64)


class StepHandle(Protocol):
    def wait(self) -> list[int]:
        """The step's sampled tokens, in the order of its sampled rows (blocks until they are known)."""
        ...

    def done(self) -> bool:
        """Whether the device has finished the step (`wait` would not block)."""
        ...


Work = Callable[[], Tensor]  # runs a step on the device; its sampled tokens, a device tensor
Launcher = Callable[[Work], StepHandle]


class _Ran:
    __slots__ = ("_tokens",)

    def __init__(self, tokens: Tensor) -> None:
        self._tokens = tokens

    def wait(self) -> list[int]:
        tokens: list[int] = self._tokens.tolist()
        return tokens

    def done(self) -> bool:
        return True


def run_now(work: Work) -> StepHandle:
    """The CPU's launcher: the CPU is the device, so a step runs when it is launched."""
    return _Ran(work())


class _Copied:
    __slots__ = ("_host", "_done")

    def __init__(self, host: Tensor, done: torch.cuda.Event) -> None:
        self._host, self._done = host, done

    def wait(self) -> list[int]:
        self._done.synchronize()
        tokens: list[int] = self._host.tolist()
        return tokens

    def done(self) -> bool:
        return bool(self._done.query())  # type: ignore[no-untyped-call]


def launch_on_cuda(work: Work) -> StepHandle:
    """Queue the step on the current stream and its tokens' copy into pinned memory behind it;
    `wait` blocks on an event (not the whole device) until the copy is done."""
    tokens = work()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # waits without spinning
    done.record()
    return _Copied(host, done)


@dataclass
class _Plan:
    """One step as host arrays, in packed-row order: decode rows, then prompt chunks."""

    token_slots: np.ndarray  # the decode rows' slots: their input ids come from the token buffer
    ids: list[int] = field(default_factory=list)  # the prompt chunks' token ids
    positions: list[np.ndarray] = field(default_factory=list)
    arena: list[np.ndarray] = field(default_factory=list)  # the arena row each token's keys and values go to
    segments: list[Segment] = field(default_factory=list)  # prompt chunks of several tokens
    gather: list[int] = field(default_factory=list)  # arena rows of segments whose blocks are not consecutive
    sample_rows: list[int] = field(default_factory=list)  # the prompt chunks' last rows that sample
    sample_slots: list[int] = field(default_factory=list)  # ... and their slots (decode rows' come first)
    attend_rows: list[int] = field(default_factory=list)  # one-token prompt chunks: rows ...
    attend_slots: list[int] = field(default_factory=list)  # ... slots ...
    attend_positions: list[int] = field(default_factory=list)  # ... and positions (decode rows' come first)
    drawn: list[int] = field(default_factory=list)  # which sampled rows draw (index into the sampled rows)
    top_k: list[int] = field(default_factory=list)  # per drawn row
    temperature: list[float] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    uniform: list[float] = field(default_factory=list)

    @property
    def num_decode(self) -> int:
        return len(self.token_slots)

    @property
    def is_pure_decode(self) -> bool:
        """Every row a decode row: what a decode graph computes."""
        return not self.ids

    @classmethod
    def of(cls, step: ScheduledStep, vocab_size: int, block_size: int) -> _Plan:
        """The prompt chunks, one by one, and the sampling parameters; `launch` adds the decode rows'
        metadata by array operations over the persistent block table."""
        n = len(step.decode)
        plan = cls(np.array(step.slots, dtype=np.int64))
        if n:
            plan.positions.append(np.array(step.positions, dtype=np.int64))
        row = n
        for chunk in step.prefill:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            table = seq.block_table
            plan.ids += seq.tokens(start, end)
            plan.positions.append(np.arange(start, end, dtype=np.int64))
            if end - start == 1:  # attends like a decode row
                plan.attend_rows.append(row)
                plan.attend_slots.append(seq.slot)
                plan.attend_positions.append(start)
                plan.arena.append(np.array([table[start // block_size] * block_size + start % block_size]))
            else:
                plan.arena.append(np.array(arena_rows(table, block_size, start, end), dtype=np.int64))
                blocks = -(-end // block_size)
                first = table[0]
                q_end = row + end - start
                if table[:blocks] == list(range(first, first + blocks)):
                    plan.segments.append(Segment(row, q_end, first * block_size, end))
                else:
                    plan.segments.append(Segment(row, q_end, -1, end, len(plan.gather)))
                    plan.gather += arena_rows(table, block_size, 0, end)
            row += end - start
            if chunk.samples:
                plan.sample_rows.append(row - 1)
                plan.sample_slots.append(seq.slot)
        for i, seq in enumerate(step.sampling):
            rng = seq.rng
            if rng is None:  # greedy
                continue
            params = seq.sampling
            plan.drawn.append(i)
            plan.top_k.append(params.top_k if 0 < params.top_k < vocab_size else 0)
            plan.temperature.append(params.temperature)
            plan.top_p.append(params.top_p)
            plan.uniform.append(rng.random())
        return plan


def arena_rows(table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The arena rows of tokens [start, end) of the sequence whose blocks are `table`."""
    rows: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = table[b] * block_size - b * block_size  # + token index = arena row
        rows += range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size))
    return rows


class ModelRunner:
    def __init__(
        self,
        model: GPT2,
        config: SchedulerConfig,
        capture: Capture | None = None,
        launcher: Launcher | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """A KV cache of the config's blocks, in `kv_dtype` (None: the model's); `capture` records
        decode graphs (cuda_graphs.py), None runs every step eagerly; `launcher` puts steps on the
        device (default: the device's)."""
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = config.kv_block_size
        kv_dtype = kv_dtype or param.dtype
        self.cache = KVCache(model.shape, config.num_blocks, config.kv_block_size, kv_dtype, param.device)
        self.scale = model.shape.head_dim**-0.5
        # A sequence's last sampled token, by slot; the last entry is the padding rows' scratch.
        self.token_buf = torch.zeros(config.running_cap + 1, dtype=torch.long, device=self.device)
        on_cuda = self.device.type == "cuda"
        self.launcher: Launcher = launcher or (launch_on_cuda if on_cuda else run_now)
        if on_cuda:
            # cuDNN's attention builds an execution plan for every new shape (~40 ms on an H200, seen
            # as eager bfloat16 steps 8x slower than float32 ones), and a step's shapes follow its
            # batch and context, so in serving nearly every step is new: SDPA picks among flash,
            # memory-efficient and math instead, which need no plan (docs/benchmarks/sittings.md, 5).
            torch.backends.cuda.enable_cudnn_sdp(False)
        kernel = cpu_decode_attention() if self.device.type == "cpu" else None
        # Attention runs in the cache's dtype (model.py), which may not be the model's.
        self.kernel = kernel if kernel is not None and kv_dtype in kernel.dtypes else None
        self.graphs = None
        if capture is not None:
            self.graphs = DecodeGraphs(model, self.cache, self.token_buf, config.max_batch_size, capture)
            log.info(
                "event=decode_graphs_captured graphs=%d seconds=%.2f",
                len(self.graphs.graphs),
                self.graphs.capture_seconds,
            )

    def launch(self, step: ScheduledStep, tables: np.ndarray) -> StepHandle:
        """Plan `step` on the host now (from `tables`, the scheduler's persistent block table) and
        put it on the device; the handle's `wait` gives its sampled tokens."""
        plan = _Plan.of(step, self.model.shape.vocab_size, self.block_size)
        # The decode rows' (and one-token chunks') metadata, by array operations.
        bs = self.block_size
        attend_slots = plan.token_slots
        attend_pos = plan.positions[0] if plan.num_decode else _EMPTY
        if plan.attend_slots:
            attend_slots = np.concatenate([attend_slots, np.array(plan.attend_slots, dtype=np.int64)])
            attend_pos = np.concatenate([attend_pos, np.array(plan.attend_positions, dtype=np.int64)])
        max_len = int(attend_pos.max()) + 1 if len(attend_pos) else 0  # the longest attending context
        width = -(-max_len // bs)  # its blocks
        attend_tables = tables[attend_slots, :width]
        if plan.num_decode:
            decode_pos = plan.positions[0]
            plan.arena.insert(0, tables[plan.token_slots, decode_pos // bs] * bs + decode_pos % bs)
        attend_rows = np.arange(plan.num_decode, dtype=np.int64)
        if plan.attend_rows:
            attend_rows = np.concatenate([attend_rows, np.array(plan.attend_rows, dtype=np.int64)])
        sample_slots = np.concatenate([plan.token_slots, np.array(plan.sample_slots, dtype=np.int64)])
        sample_rows = np.concatenate(
            [np.arange(plan.num_decode, dtype=np.int64), np.array(plan.sample_rows, dtype=np.int64)]
        )
        ints = [
            plan.token_slots,
            np.array(plan.ids, dtype=np.int64),
            np.concatenate(plan.positions) if plan.positions else _EMPTY,
            np.concatenate(plan.arena) if plan.arena else _EMPTY,
            np.array(plan.gather, dtype=np.int64),
            sample_rows,
            sample_slots,
            attend_rows,
            attend_tables.reshape(-1),
            attend_pos + 1,
            np.array(plan.drawn, dtype=np.int64),
            np.array(plan.top_k, dtype=np.int64),
        ]
        floats = [np.array(values, dtype=np.float64) for values in (plan.temperature, plan.top_p, plan.uniform)]
        return self.launcher(partial(self._execute, plan, ints, floats, width, max_len))

    def _execute(
        self, plan: _Plan, ints: list[np.ndarray], floats: list[np.ndarray], width: int, max_len: int
    ) -> Tensor:
        """The device part of a step: stage, forward, sample, and keep the tokens in `token_buf`."""
        staged_ints, staged_floats = self._stage(ints, floats)
        token_slots, ids, positions, arena, gather, sample_rows, sample_slots = staged_ints[:7]
        attend_rows, attend_tables, attend_lens, drawn, top_k = staged_ints[7:]
        temperature, top_p, uniform = staged_floats
        tables = attend_tables.view(attend_rows.numel(), width)
        bucket = None
        if self.graphs is not None and plan.is_pure_decode:
            bucket = self.graphs.bucket(plan.num_decode, max_len)
        if bucket is not None:
            assert self.graphs is not None
            logits = self.graphs.run(bucket, token_slots, positions, arena, tables, attend_lens)
        else:
            if plan.num_decode:
                fed_back = self.token_buf.index_select(0, token_slots)
                ids = torch.cat([fed_back, ids]) if len(plan.ids) else fed_back
            decode = self._decode_attention(attend_rows, tables, attend_lens, max_len, arena)
            every_row = sample_rows.numel() == positions.numel()
            batch = PackedBatch(
                ids,
                positions,
                arena,
                decode,
                plan.segments,
                gather if plan.gather else None,
                None if every_row else sample_rows,
            )
            logits = self.model(batch, self.cache)
        if not sample_rows.numel():
            return sample_rows  # an empty tensor: nothing samples
        sampled = None
        if plan.drawn:
            sampled = SampledRows(
                drawn, temperature, top_k, top_p, uniform, max(plan.top_k), any(p < 1 for p in plan.top_p)
            )
        tokens = sample(logits, sampled)
        self.token_buf.index_copy_(0, sample_slots, tokens)
        return tokens

    def _decode_attention(
        self, rows: Tensor, tables: Tensor, lens: Tensor, max_len: int, slots: Tensor
    ) -> DecodeAttention | None:
        if not max_len:
            return None
        if self.kernel is not None:
            return KernelDecode(self.kernel.prepare(rows, tables, lens, self.block_size, self.scale, slots))
        return GatherDecode(rows, tables, lens, max_len, self.block_size, self.scale)

    def _stage(self, ints: list[np.ndarray], floats: list[np.ndarray]) -> tuple[list[Tensor], list[Tensor]]:
        """The arrays as device tensors (int64 and float64 views of one buffer), in one transfer.
        The buffer is built the same way on every device, so the CPU tests run this code too."""
        flat_ints = np.concatenate(ints)
        flat_floats = np.concatenate(floats)
        split = 8 * len(flat_ints)
        on_cpu = self.device.type == "cpu"
        host = torch.empty(split + 8 * len(flat_floats), dtype=torch.uint8, pin_memory=not on_cpu)
        host[:split].view(torch.int64).numpy()[:] = flat_ints
        host[split:].view(torch.float64).numpy()[:] = flat_floats
        staged = host if on_cpu else host.to(self.device, non_blocking=True)
        return _split(staged[:split].view(torch.int64), ints), _split(staged[split:].view(torch.float64), floats)


def _split(flat: Tensor, parts: list[np.ndarray]) -> list[Tensor]:
    return list(torch.split(flat, [len(part) for part in parts]))
