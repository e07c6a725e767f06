"""A compact GPT-2 forward over packed sequences, reading and writing the KV arena in place.

Parameter names mirror Hugging Face's `GPT2LMHeadModel` (`transformer.h.0.attn.c_attn.weight`, ...)
and its Conv1D layout ([in, out]), so loading is a key-by-key copy with shape checks
(`load_hf_state_dict`). Correctness is judged against transformers itself (tests/engine).

Why not call `GPT2LMHeadModel` per step: its cache concatenates or needs a rectangular batch, it
materialises padding, and its per-layer overhead is large at small batch. Here all tokens of a
step (decode tokens and prompt chunks of several sequences) are packed into one [N, C] matrix, so
every matrix multiply runs once per layer with no padding; attention reads each sequence's own
blocks of the paged arena (attention.py).

On the CPU the linear layers and the tied LM head run on oneDNN with weights reordered once into
its blocked layout (`pack_for_cpu`), the path torch's own compiler takes for CPU inference. For
GPT-2 small at 2 threads (AMD EPYC, float32) the 48 layer matmuls of a decode step took 45.8 ms
at batch 32 against 64.4 ms for `F.linear` and 99 ms for `addmm` on the [in, out] weights, 21.5
against 39.5 ms at batch 8, and within 2-6% of `F.linear` at prefill sizes (128-2,048 rows); the
LM head at batch 32 21.9 against 26.5 ms. It is also oneDNN that runs bfloat16 natively.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker import int8
from worker.attention import DecodeAttention, Segment, causal_masks, prefill_attention
from worker.kernels.int8_linear import PackedInt8
from worker.kv_cache import KVCache
from worker.model_shape import GPT2Shape


@dataclass(frozen=True, slots=True)
class PackedBatch:
    input_ids: Tensor  # [N] token ids of every chunk, concatenated
    positions: Tensor  # [N] absolute position of each token within its sequence
    slots: Tensor  # [N] arena row each token's keys and values are written to
    decode: DecodeAttention | None  # the single-token rows, attended in one call per layer
    segments: list[Segment]  # prompt chunks of several tokens, attended each on its own
    gather: Tensor | None  # [G] arena rows of the segments whose blocks are not consecutive
    sample_rows: Tensor | None  # [n] packed rows whose logits are needed; None: every row


def can_pack_for_cpu(dtype: torch.dtype) -> bool:
    """Whether oneDNN can run linear layers of `dtype` on this CPU (bf16 and fp16 need AVX-512 or
    AVX-NE-CONVERT: elsewhere their reorder refuses)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def _packed(weight: Tensor, batch_hint: int) -> Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout for about `batch_hint` rows (an
    opaque tensor, usable for any number of rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, gelu: bool = False) -> Tensor:
    """x @ W + b on oneDNN's packed weight; `gelu`: GPT-2's tanh GELU applied as the matmul's
    post-op, in float32 before the result is rounded to the weights' dtype (one pass over the
    output instead of two, and a rounding less in bfloat16)."""
    if gelu:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [], "tanh")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Conv1D(nn.Module):
    """HF GPT-2's linear layer: weight stored [in, out]; y = x @ W + b. After `pack_for_cpu` the
    weight lives only in oneDNN's layout; after `quantize_int8`, only as int8 (worker/int8.py)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))
        self.packed: Tensor | None = None
        self.int8: PackedInt8 | None = None

    def forward(self, x: Tensor, gelu: bool = False) -> Tensor:
        """`gelu`: followed by GPT-2's GELU (its tanh approximation), fused where oneDNN or the int8
        kernel runs it."""
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias, gelu)
        if self.int8 is not None:
            return self.int8(x, gelu)
        assert self.weight is not None  # one of the three is always set
        y = torch.addmm(self.bias, x, self.weight)
        return F.gelu(y, approximate="tanh") if gelu else y

    def pack_for_cpu(self, batch_hint: int) -> None:
        if self.weight is None:  # quantized: nothing dense to pack
            return
        self.packed = _packed(self.weight.t(), batch_hint)
        self.weight = None  # the dense copy would double the memory

    def quantize_int8(self) -> None:
        assert self.weight is not None
        self.int8 = int8.pack(self.weight, self.bias)
        self.weight = None


class Attention(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.n_head = shape.n_head
        self.head_dim = shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.c_attn = Conv1D(shape.n_embd, 3 * shape.n_embd)
        self.c_proj = Conv1D(shape.n_embd, shape.n_embd)

    def forward(
        self, x: Tensor, batch: PackedBatch, masks: list[Tensor | None], keys: Tensor, values: Tensor
    ) -> Tensor:
        n, c = x.shape
        qkv = self.c_attn.forward(x)
        if qkv.dtype != keys.dtype:  # a KV cache in another dtype (--kv-cache-dtype): attention runs in it
            qkv = qkv.to(keys.dtype)
        q, k, v = qkv.view(n, 3, self.n_head, self.head_dim).unbind(1)  # each [N, H, D]
        decode = batch.decode
        if decode is not None and decode.writes_kv:  # it writes the single-token rows' own
            for seg in batch.segments:
                rows = slice(seg.q_start, seg.q_end)
                keys.index_copy_(1, batch.slots[rows], k[rows].transpose(0, 1))
                values.index_copy_(1, batch.slots[rows], v[rows].transpose(0, 1))
        else:
            keys.index_copy_(1, batch.slots, k.transpose(0, 1))  # arena [H, T, D]
            values.index_copy_(1, batch.slots, v.transpose(0, 1))
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [N, H, D]: every row is written below
        if decode is not None:
            decode(q, k, v, keys, values, out)
        if batch.segments:
            prefill_attention(q, keys, values, batch.segments, masks, batch.gather, out, self.scale)
        return self.c_proj.forward(out.view(n, c).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.c_fc = Conv1D(shape.n_embd, shape.n_inner)
        self.c_proj = Conv1D(shape.n_inner, shape.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.c_proj.forward(self.c_fc.forward(x, gelu=True))


class Block(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)
        self.attn = Attention(shape)
        self.ln_2 = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)
        self.mlp = MLP(shape)

    def forward(
        self, x: Tensor, batch: PackedBatch, masks: list[Tensor | None], keys: Tensor, values: Tensor
    ) -> Tensor:
        """x [N, C], updated in place (the caller's own): the residual stream."""
        x += self.attn.forward(_layer_norm(self.ln_1, x), batch, masks, keys, values)
        return x.add_(self.mlp.forward(_layer_norm(self.ln_2, x)))


def _layer_norm(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class Transformer(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.wpe = nn.Embedding(shape.n_positions, shape.n_embd)
        self.blocks = [Block(shape) for _ in range(shape.n_layer)]  # typed, for the layer loop
        self.h = nn.ModuleList(self.blocks)
        self.ln_f = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)


class GPT2(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.shape = shape
        self.transformer = Transformer(shape)
        self.lm_head_packed: Tensor | None = None  # the tied LM head in oneDNN's layout, after pack_for_cpu
        self.lm_head_int8: PackedInt8 | None = None  # its int8 copy, after quantize_int8

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, cache: KVCache) -> Tensor:
        """Run every chunk of `batch`, writing their keys and values; logits [n, V] of sample_rows."""
        t = self.transformer
        x = t.wte(batch.input_ids) + t.wpe(batch.positions)  # [N, C]
        masks = causal_masks(batch.segments, x.device)
        # `forward` rather than the modules' __call__, which adds hook checks to each of ~100 calls a step
        for i, block in enumerate(t.blocks):
            x = block.forward(x, batch, masks, cache.keys[i], cache.values[i])
        if batch.sample_rows is not None:
            x = x.index_select(0, batch.sample_rows)
        return self.lm_head(_layer_norm(t.ln_f, x))

    def lm_head(self, x: Tensor) -> Tensor:
        """Logits [n, V] of final hidden states [n, C] (the LM head is tied to the embedding)."""
        if self.lm_head_int8 is not None:
            return self.lm_head_int8(x)
        if self.lm_head_packed is not None:
            return _packed_linear(x, self.lm_head_packed, None)
        return F.linear(x, self.transformer.wte.weight)

    def pack_for_cpu(self, batch_hint: int) -> None:
        """Reorder every linear layer and the LM head for oneDNN (see the module docstring); for
        about `batch_hint` rows per matmul (the decode batch), though any number works."""
        for module in self.modules():
            if isinstance(module, Conv1D):
                module.pack_for_cpu(batch_hint)
        if self.lm_head_int8 is None:
            self.lm_head_packed = _packed(self.transformer.wte.weight, batch_hint)

    def quantize_int8(self) -> None:
        """Every linear layer's weight and the LM head to int8 (worker/int8.py; the head from a copy
        of the embedding it is tied to, which stays float32 for the inputs). Before `pack_for_cpu`,
        which then has nothing left to pack."""
        for module in self.modules():
            if isinstance(module, Conv1D):
                module.quantize_int8()
        self.lm_head_int8 = int8.pack(self.transformer.wte.weight.t(), None)

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


def _is_ignorable(key: str) -> bool:
    # Old checkpoints carry the causal-mask buffers; the LM head is tied to wte.
    return key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight"
