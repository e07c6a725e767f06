"""The C decode-attention kernel (decode_attention.c) bound through ctypes, for CPU tensors.

ctypes releases the GIL for the call, so the worker's event loop keeps running while a layer's
attention runs. The C code trusts its arguments, so their types, shapes and layouts are checked
here: a step's index tensors once, when the step is bound (`prepare`), and each layer's tensors
by their layout, which is the same in every layer of a step, so after the first layer the check is
one tuple comparison. Their values are the runner's invariants (runner.py builds them all), not
checked: every row index below q's rows and no row twice, every length within its block table,
every block and slot inside the arena.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from worker.kernels.build import build_or_none

log = logging.getLogger("worker.kernels")

SOURCE = Path(__file__).with_name("decode_attention.c")
MAX_HEAD_DIM = 256  # as in the C source
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [
    *(_ptr, _i64, _ptr, _ptr, _i64),  # q, its row stride, keys, values, their head stride
    *(_ptr, _ptr, _i64, _ptr, _i64),  # rows, tables, the tables' row stride, lens, n
    *(_ptr, _ptr, _i64, _ptr),  # the new keys and values (or NULL), their row stride, arena rows by packed row
    *(_ptr, _i64, _i64, _i64, _i64),  # out, its row stride, heads, head dim, block size
    *(ctypes.c_float, ctypes.c_int),  # scale, threads
]


class DecodeAttentionKernel:
    """`kernel(q, keys, values, rows, tables, lens, block_size, out, scale)`: for each i, the
    attention of query row rows[i] of q [N, H, D] over the first lens[i] tokens of the sequence
    whose blocks are tables[i] ([B, W]) in the arena keys/values [H, T, D], written to row rows[i]
    of out [N, H, D]. `isa` names the vector code the library was compiled to (avx512_bf16,
    avx512, avx2 or portable)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.decode_attention_isa.restype = ctypes.c_char_p
        self.isa: str = lib.decode_attention_isa().decode()
        self.dtypes: dict[torch.dtype, Callable[..., int]] = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            function = getattr(lib, f"decode_attention_{str(dtype).removeprefix('torch.')}", None)
            if function is not None:  # float16 needs a compiler with _Float16
                function.argtypes = _ARGTYPES
                function.restype = ctypes.c_int
                self.dtypes[dtype] = function

    def prepare(
        self, rows: Tensor, tables: Tensor, lens: Tensor, block_size: int, scale: float, slots: Tensor | None = None
    ) -> StepAttention:
        """One step's decode rows bound to the kernel, their index tensors checked. `slots` [N]:
        each packed row's arena row, where a call given the layer's new keys and values writes the
        decode rows' own."""
        n = rows.numel()
        for t in (rows, lens):
            if t.dtype != torch.int64 or t.numel() != n or not t.is_contiguous() or not t.is_cpu:
                raise ValueError("decode attention: rows and lens must be contiguous int64 of one length")
        if (
            tables.dtype != torch.int64
            or tables.dim() != 2
            or tables.shape[0] != n
            or tables.stride(1) != 1
            or not tables.is_cpu
        ):
            raise ValueError("decode attention: tables must be int64 [n, W] with contiguous rows")
        if slots is not None and (slots.dtype != torch.int64 or not slots.is_contiguous() or not slots.is_cpu):
            raise ValueError("decode attention: slots must be contiguous int64")
        if block_size < 1:
            raise ValueError(f"decode attention: block size {block_size}")
        return StepAttention(self, rows, tables, lens, block_size, scale, slots)

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
        self.prepare(rows, tables, lens, block_size, scale)(q, keys, values, out)


class StepAttention:
    """`step(q, keys, values, out, k, v)`: the kernel over one layer's tensors for the rows bound
    by `DecodeAttentionKernel.prepare`; given k and v ([N, H, D] like q), each row's own key and
    value are written to the arena first (at its slot)."""

    def __init__(
        self,
        kernel: DecodeAttentionKernel,
        rows: Tensor,
        tables: Tensor,
        lens: Tensor,
        block_size: int,
        scale: float,
        slots: Tensor | None,
    ) -> None:
        self.kernel = kernel
        self._keep = (rows, tables, lens, slots)  # the pointers below stay valid while this lives
        self._index_args = (rows.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), rows.numel())
        self.slots = slots
        self.block_size = block_size
        self.scale = scale
        self._checked: tuple[object, ...] | None = None  # the layout last checked
        self._function: Callable[..., int] | None = None

    def __call__(
        self, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, k: Tensor | None = None, v: Tensor | None = None
    ) -> None:
        layout: tuple[object, ...] = (q.dtype, q.shape, q.stride(), keys.dtype, keys.shape, keys.stride())
        layout += (values.dtype, values.shape, values.stride(), out.dtype, out.shape, out.stride())
        layout += (q.is_cpu, keys.is_cpu, values.is_cpu, out.is_cpu)
        if k is not None and v is not None:
            layout += (k.dtype, k.shape, k.stride(), v.dtype, v.shape, v.stride(), k.is_cpu, v.is_cpu)
        elif k is not None or v is not None:
            raise ValueError("decode attention: new keys without new values, or the reverse")
        if layout != self._checked:
            self._function = self._check(q, keys, values, out, k, v)
            self._checked = layout
        assert self._function is not None
        heads, _, dim = keys.shape
        status = self._function(
            q.data_ptr(),
            q.stride(0),
            keys.data_ptr(),
            values.data_ptr(),
            keys.stride(0),
            *self._index_args,
            None if k is None else k.data_ptr(),
            None if v is None else v.data_ptr(),
            0 if k is None else k.stride(0),
            None if self.slots is None else self.slots.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            heads,
            dim,
            self.block_size,
            self.scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"decode attention kernel refused its arguments (status {status})")

    def _check(
        self, q: Tensor, keys: Tensor, values: Tensor, out: Tensor, k: Tensor | None, v: Tensor | None
    ) -> Callable[..., int]:
        function = self.kernel.dtypes.get(q.dtype)
        new = [t for t in (k, v) if t is not None]
        if function is None or not all(t.dtype == q.dtype and t.is_cpu for t in (q, keys, values, out, *new)):
            raise ValueError(f"decode attention: no kernel for {q.dtype} on {q.device}")
        heads, _, dim = keys.shape
        if dim > MAX_HEAD_DIM or any(t.shape[1:] != (heads, dim) for t in (q, out, *new)):
            raise ValueError(f"decode attention: shapes q {tuple(q.shape)}, arena {tuple(keys.shape)}")
        for name, t in (("q", q), ("out", out), *(("k", t) for t in new)):
            if t.stride(2) != 1 or t.stride(1) != dim:
                raise ValueError(f"decode attention: {name} must have contiguous heads, strides {t.stride()}")
        if keys.shape != values.shape or keys.stride() != values.stride() or keys.stride()[1:] != (dim, 1):
            raise ValueError(f"decode attention: arena strides {keys.stride()} / {values.stride()}")
        if new:
            assert k is not None and v is not None
            if k.shape != q.shape or v.shape != q.shape or k.stride() != v.stride():
                raise ValueError(f"decode attention: new keys {tuple(k.shape)}, queries {tuple(q.shape)}")
            if self.slots is None or self.slots.numel() != q.shape[0]:
                raise ValueError("decode attention: writing new keys needs a slot for every packed row")
        return function


@functools.cache
def cpu_decode_attention() -> DecodeAttentionKernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built here."""
    kernel = build_or_none(SOURCE, DecodeAttentionKernel, "gather")
    if kernel is None:
        return None
    log.info("event=kernel_loaded kernel=decode_attention isa=%s", kernel.isa)
    return kernel
