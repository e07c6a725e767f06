"""A compact GPT-2 forward over packed sequences, reading and writing the KV arena in place.

Parameter names mirror Hugging Face's `GPT2LMHeadModel` (`transformer.h.0.attn.c_attn.weight`, ...)
and its Conv1D layout ([in, out]), so loading is a key-by-key copy with shape checks
(`load_hf_state_dict`). Correctness is judged against transformers itself (tests/engine).

Why not call `GPT2LMHeadModel` per step: its cache concatenates or needs a rectangular batch, it
materialises padding, and its per-layer overhead is large at small batch. Here all tokens of a
step (decode tokens and prompt chunks of several sequences) are packed into one [N, C] matrix, so
every matrix multiply runs once per layer with no padding; only attention is per sequence, over
that sequence's own span of the arena (no copy, no padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.kv_cache import KVCache
from worker.model_shape import GPT2Shape

LM_HEAD_TRANSPOSE_ROWS = 4


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's chunk inside a packed step: query rows [q_start, q_end) of the packed batch,
    attending to arena rows [kv_start, kv_start + kv_len) (its cached tokens plus this chunk)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_len: int


@dataclass(frozen=True, slots=True)
class PackedBatch:
    input_ids: Tensor  # [N] token ids of every chunk, concatenated
    positions: Tensor  # [N] absolute position of each token within its sequence
    slots: Tensor  # [N] arena row each token's keys and values are written to
    segments: list[Segment]
    sample_rows: Tensor  # [n] packed row whose logits are needed (last token of a sampling chunk)


class Conv1D(nn.Module):
    """HF GPT-2's linear layer: weight stored [in, out]; y = x @ W + b."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x, self.weight)


class Attention(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.n_head = shape.n_head
        self.head_dim = shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.c_attn = Conv1D(shape.n_embd, 3 * shape.n_embd)
        self.c_proj = Conv1D(shape.n_embd, shape.n_embd)

    def forward(self, x: Tensor, batch: PackedBatch, keys: Tensor, values: Tensor) -> Tensor:
        n, c = x.shape
        q, k, v = self.c_attn(x).view(n, 3, self.n_head, self.head_dim).unbind(1)  # each [N, H, D]
        keys.index_copy_(1, batch.slots, k.transpose(0, 1))  # arena [H, T, D]
        values.index_copy_(1, batch.slots, v.transpose(0, 1))
        q = q * self.scale  # once for every row, so the per-sequence loop below stays short
        out = torch.empty_like(q)  # [N, H, D]
        for seg in batch.segments:
            q_len = seg.q_end - seg.q_start
            q_seg = q[seg.q_start : seg.q_end].transpose(0, 1)  # [H, L, D]
            k_seg = keys[:, seg.kv_start : seg.kv_start + seg.kv_len]  # [H, S, D], a view of the arena
            v_seg = values[:, seg.kv_start : seg.kv_start + seg.kv_len]
            if q_len == 1:
                # A decode token sees every cached key. Plain bmm's, the result written in place:
                # SDPA's general path costs twice as much per call, and a decode step makes one
                # call per sequence and layer.
                scores = torch.bmm(q_seg, k_seg.transpose(1, 2))  # [H, 1, S]
                torch.bmm(scores.softmax(dim=-1), v_seg, out=out[seg.q_start].unsqueeze(1))
                continue
            if q_len == seg.kv_len:  # a whole prompt: plainly causal
                o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, is_causal=True, scale=1.0)
            else:
                # A later prompt chunk: query i sits at position kv_len - q_len + i.
                mask = torch.ones(q_len, seg.kv_len, dtype=torch.bool, device=x.device).tril(seg.kv_len - q_len)
                o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, attn_mask=mask, scale=1.0)
            out[seg.q_start : seg.q_end] = o.transpose(0, 1)
        return self.c_proj(out.view(n, c))


class MLP(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.c_fc = Conv1D(shape.n_embd, shape.n_inner)
        self.c_proj = Conv1D(shape.n_inner, shape.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)
        self.attn = Attention(shape)
        self.ln_2 = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)
        self.mlp = MLP(shape)

    def forward(self, x: Tensor, batch: PackedBatch, keys: Tensor, values: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), batch, keys, values)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.wpe = nn.Embedding(shape.n_positions, shape.n_embd)
        self.h = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)


class GPT2(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.shape = shape
        self.transformer = Transformer(shape)
        # The tied LM head. Below LM_HEAD_TRANSPOSE_ROWS rows, `x @ W` on a contiguous [C, V] copy
        # of the embedding is the fastest form on CPU; from there on, `wte @ x.T` is (GPT-2 small,
        # fp32, 2 threads, ms per call: batch 1: 8.5 / 12.1, batch 8: 21.2 / 15.7, batch 32:
        # 33.3 / 25.5; F.linear: 12.0, 23.2, 37.1). The copy costs V x C more memory (147 MiB).
        self.lm_head_t: Tensor
        self.register_buffer("lm_head_t", torch.empty(shape.n_embd, shape.vocab_size), persistent=False)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, cache: KVCache) -> Tensor:
        """Run every chunk of `batch`, writing their keys and values; logits [n, V] of sample_rows."""
        t = self.transformer
        x = t.wte(batch.input_ids) + t.wpe(batch.positions)  # [N, C]
        for i, block in enumerate(t.h):
            x = block(x, batch, cache.keys[i], cache.values[i])
        last = t.ln_f(x.index_select(0, batch.sample_rows))  # [n, C]
        if last.shape[0] < LM_HEAD_TRANSPOSE_ROWS:
            return last @ self.lm_head_t  # [n, V]
        return torch.mm(t.wte.weight, last.t()).t()  # [V, n] -> a [n, V] view

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy weights from a `GPT2LMHeadModel` state dict (shapes checked, nothing left over)."""
        ours = self.state_dict()
        theirs = {k: v for k, v in state.items() if k in ours or not _is_ignorable(k)}
        missing = sorted(set(ours) - set(theirs))
        unexpected = sorted(set(theirs) - set(ours))
        if missing or unexpected:
            raise ValueError(f"not a GPT-2 state dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for key, value in theirs.items():
            if tuple(value.shape) != tuple(ours[key].shape):
                raise ValueError(f"{key}: shape {tuple(value.shape)}, expected {tuple(ours[key].shape)}")
        self.load_state_dict(theirs)
        with torch.no_grad():
            self.lm_head_t.copy_(self.transformer.wte.weight.t())


def _is_ignorable(key: str) -> bool:
    # Old checkpoints carry the causal-mask buffers; the LM head is tied to wte.
    return key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight"
