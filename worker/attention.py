"""Attention over the paged KV cache for one step: decode rows in one call per layer, prompt chunks each.

A sequence's keys and values lie in its blocks (kv_cache.py): token t at arena row
`table[t // block_size] * block_size + t % block_size`. A step's rows are of two kinds. A
single-token row (a decoding sequence, or a one-token prompt chunk) attends to its sequence's
whole context: all of them go through one `DecodeAttention` call per layer, built once per step
from the rows' block tables. A prompt chunk of several tokens attends causally to its context and
goes through SDPA on its own (4-D inputs, so torch's fused CPU and CUDA kernels take it instead of
the math fallback that 3-D inputs get: 2-4.6x faster on 64-1,024-token prompts on the CPU); its
context is a view of the arena where its blocks are consecutive (as a fresh pool hands them
out), else gathered by row.

Two decode implementations, chosen by the runner for its device:
- `KernelDecode` (CPU): the C kernel reads each block where it lies (kernels/decode_attention.c).
- `GatherDecode` (CUDA, and CPU where no C compiler is at hand): maps the block tables to a padded
  [B, S] row index and runs SDPA under a length mask. Only tensor ops on tensors built once per
  step, with S fixed by the caller: this is what a CUDA graph can capture. The gather copies the
  context, which a GPU streams in microseconds and a CPU does not.
Both compute the softmax in float32 whatever the storage dtype (SDPA's kernels do internally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.kernels.decode_attention import StepAttention


@dataclass(frozen=True, slots=True)
class Segment:
    """A prompt chunk of several tokens inside a packed step: query rows [q_start, q_end) of the
    packed batch, attending to its sequence's first `kv_len` tokens (cached ones plus this chunk):
    arena rows [kv_start, kv_start + kv_len) when its blocks are consecutive, else (kv_start -1)
    the rows listed at [gather_at, gather_at + kv_len) of the step's gather index."""

    q_start: int
    q_end: int
    kv_start: int
    kv_len: int
    gather_at: int = 0


class DecodeAttention(Protocol):
    writes_kv: bool  # the call writes its rows' own keys and values (k, v) into the arena first

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, out: Tensor) -> None:
        """Attention of this step's single-token rows of q [N, H, D] over one layer's arena
        [H, T, D], written to the same rows of out [N, H, D]; k and v [N, H, D] are the layer's
        new keys and values, already in the arena unless `writes_kv`."""


class KernelDecode:
    """A step's decode rows bound to the C kernel as a `DecodeAttention` (the protocol's argument
    order, and a name for torch.profiler). `DecodeAttentionKernel.prepare` binds them, checking
    the index tensors once for the step: rows [B], tables [B, W], lens [B] and slots [N] (needed:
    the kernel writes the rows' own keys and values), int64 on the CPU."""

    writes_kv = True

    def __init__(self, step: StepAttention) -> None:
        self.step = step

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, out: Tensor) -> None:
        # Named for torch.profiler, which sees no torch op inside a ctypes call.
        with torch.profiler.record_function("governor::decode_attention"):
            self.step(q, keys, values, out, k, v)


class GatherDecode:
    writes_kv = False

    def __init__(self, rows: Tensor, tables: Tensor, lens: Tensor, max_len: int, block_size: int, scale: float) -> None:
        """`tables` [B, W] covers every length; `max_len` >= every length: the padded width S (a
        CUDA graph's context bucket), with (S - 1) // block_size < W."""
        positions = torch.arange(max_len, device=rows.device)
        valid = positions < lens[:, None]  # [B, S]
        blocks = tables.gather(1, (positions // block_size).expand(tables.shape[0], max_len))  # [B, S]
        first = tables[:, :1] * block_size  # [B, 1]
        # Padding positions read the sequence's first row: in bounds, and masked out below.
        self.index = torch.where(valid, blocks * block_size + positions % block_size, first)  # [B, S]
        self.mask = valid[:, None, None, :]  # [B, 1, 1, S]
        self.rows = rows
        self.scale = scale

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, out: Tensor) -> None:
        context_k = keys[:, self.index].transpose(0, 1)  # [H, B, S, D] -> [B, H, S, D]
        context_v = values[:, self.index].transpose(0, 1)
        query = q.index_select(0, self.rows).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(query, context_k, context_v, attn_mask=self.mask, scale=self.scale)
        out.index_copy_(0, self.rows, o.squeeze(2))


def causal_masks(segments: list[Segment], device: torch.device) -> list[Tensor | None]:
    """Each segment's attention mask, built once per step for every layer: None for a whole prompt
    (plainly causal), else [q_len, kv_len] with query i at position kv_len - q_len + i."""
    masks: list[Tensor | None] = []
    for seg in segments:
        q_len = seg.q_end - seg.q_start
        if q_len == seg.kv_len:
            masks.append(None)
        else:
            masks.append(torch.ones(q_len, seg.kv_len, dtype=torch.bool, device=device).tril(seg.kv_len - q_len))
    return masks


def prefill_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    segments: list[Segment],
    masks: list[Tensor | None],
    gather: Tensor | None,
    out: Tensor,
    scale: float,
) -> None:
    """Causal attention of each prompt chunk over its context, written to its rows of out [N, H, D];
    `masks` from `causal_masks`; `gather` holds the arena rows of the segments whose blocks are not
    consecutive."""
    for seg, mask in zip(segments, masks, strict=True):
        q_seg = q[seg.q_start : seg.q_end].transpose(0, 1)[None]  # [1, H, L, D]
        if seg.kv_start >= 0:
            k_seg = keys[None, :, seg.kv_start : seg.kv_start + seg.kv_len]  # [1, H, S, D], a view of the arena
            v_seg = values[None, :, seg.kv_start : seg.kv_start + seg.kv_len]
        else:
            assert gather is not None  # the runner stages it whenever a segment needs it
            index = gather[seg.gather_at : seg.gather_at + seg.kv_len]
            k_seg = keys.index_select(1, index)[None]  # [1, H, S, D], a copy
            v_seg = values.index_select(1, index)[None]
        if mask is None:
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, attn_mask=mask, scale=scale)
        out[seg.q_start : seg.q_end] = o[0].transpose(0, 1)
