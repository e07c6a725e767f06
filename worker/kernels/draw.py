"""The C sampler (draw.c) bound through ctypes: a token for each sampled row of CPU logits."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from worker.kernels.build import build_or_none

SOURCE = Path(__file__).with_name("draw.c")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class DrawKernel:
    """`kernel(x, inv_t, top_k, top_p, uniform)`: a token id for each row of x (float32 logits
    [m, V], rows contiguous), drawn by its inverse temperature (float32), top-k (int64; 0: none),
    top-p (float64; 1: none) and uniform number (float64 in [0, 1)), as int64 [m]. The draw is
    worker/sampling.py's, without a sort of the vocabulary (see draw.c)."""

    def __init__(self, library: Path) -> None:
        self.function = ctypes.CDLL(str(library)).draw_float32
        self.function.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
        self.function.restype = ctypes.c_int

    def __call__(self, x: Tensor, inv_t: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor) -> Tensor:
        m, vocab = x.shape
        if x.dtype != torch.float32 or not x.is_cpu or x.stride(1) != 1:
            raise ValueError(f"draw: float32 CPU logits with contiguous rows, not {x.dtype} {x.stride()}")
        for t, dtype in (
            (inv_t, torch.float32),
            (top_k, torch.int64),
            (top_p, torch.float64),
            (uniform, torch.float64),
        ):
            if t.dtype != dtype or t.shape != (m,) or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"draw: each row's parameter must be a contiguous {dtype} [{m}]")
        out = torch.empty(m, dtype=torch.int64)
        if not m:
            return out
        scratch = torch.empty(m, vocab, dtype=torch.float32)
        status = self.function(
            x.data_ptr(),
            m,
            vocab,
            x.stride(0),
            inv_t.data_ptr(),
            top_k.data_ptr(),
            top_p.data_ptr(),
            uniform.data_ptr(),
            scratch.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("draw: no memory for the sampler's buckets")
        if status:
            raise ValueError(f"draw: rows of {vocab} logits")
        return out


@functools.cache
def cpu_draw() -> DrawKernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built here."""
    return build_or_none(SOURCE, DrawKernel, "torch")
