"""The C decode-attention kernel (decode_attention.c) bound through ctypes, for CPU tensors.

ctypes releases the GIL for the call, so the worker's event loop keeps running while a layer's
attention runs. The arguments are checked here, once per call, because the C code trusts them;
that every length stays within its block table is the runner's invariant (runner.py builds both).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from worker.kernels.build import KernelUnavailable, build

log = logging.getLogger("worker.kernels")

SOURCE = Path(__file__).with_name("decode_attention.c")
MAX_HEAD_DIM = 256  # as in the C source
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [
    *(_ptr, _i64, _ptr, _ptr, _i64),  # q, its row stride, keys, values, their head stride
    *(_ptr, _ptr, _i64, _ptr, _i64),  # rows, tables, the tables' row stride, lens, n
    *(_ptr, _i64, _i64, _i64, _i64),  # out, its row stride, heads, head dim, block size
    *(ctypes.c_float, ctypes.c_int),  # scale, threads
]


class DecodeAttentionKernel:
    """`kernel(q, keys, values, rows, tables, lens, block_size, out, scale)`: for each i, the
    attention of query row rows[i] of q [N, H, D] over the first lens[i] tokens of the sequence
    whose blocks are tables[i] ([B, W]) in the arena keys/values [H, T, D], written to row rows[i]
    of out [N, H, D]."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self.dtypes: dict[torch.dtype, Callable[..., int]] = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            function = getattr(lib, f"decode_attention_{str(dtype).removeprefix('torch.')}", None)
            if function is not None:  # float16 needs a compiler with _Float16
                function.argtypes = _ARGTYPES
                function.restype = ctypes.c_int
                self.dtypes[dtype] = function

    def __call__(
        self,
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        rows: Tensor,
        tables: Tensor,
        lens: Tensor,
        block_size: int,
        out: Tensor,
        scale: float,
    ) -> None:
        function = self.dtypes.get(q.dtype)
        n, (heads, _, dim) = rows.numel(), keys.shape
        if function is None or not all(t.dtype == q.dtype and t.device.type == "cpu" for t in (keys, values, out)):
            raise ValueError(f"decode attention: no kernel for {q.dtype} on {q.device}")
        if dim > MAX_HEAD_DIM or q.shape[1:] != (heads, dim) or out.shape[1:] != (heads, dim):
            raise ValueError(f"decode attention: shapes q {tuple(q.shape)}, arena {tuple(keys.shape)}")
        for name, t in (("q", q), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != dim:
                raise ValueError(f"decode attention: {name} must have contiguous heads, strides {t.stride()}")
        if keys.stride() != values.stride() or keys.stride()[1:] != (dim, 1):
            raise ValueError(f"decode attention: arena strides {keys.stride()} / {values.stride()}")
        for t in (rows, lens):
            if t.dtype != torch.int64 or t.numel() != n or not t.is_contiguous():
                raise ValueError("decode attention: rows and lens must be contiguous int64 of one length")
        if tables.dtype != torch.int64 or tables.dim() != 2 or tables.shape[0] != n or tables.stride(1) != 1:
            raise ValueError("decode attention: tables must be int64 [n, W] with contiguous rows")
        status = function(
            q.data_ptr(),
            q.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            keys.stride(0),
            rows.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            n,
            out.data_ptr(),
            out.stride(0),
            heads,
            dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"decode attention kernel failed (status {status})")


@functools.cache
def cpu_decode_attention() -> DecodeAttentionKernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built here."""
    try:
        return DecodeAttentionKernel(build(SOURCE))
    except (KernelUnavailable, OSError) as exc:
        log.warning("event=kernel_unavailable kernel=decode_attention fallback=gather reason=%r", str(exc))
        return None
