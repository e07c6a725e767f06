"""The C int8 linear kernel (int8_linear.c) bound through ctypes: a weight packed once, then
quantize, integer GEMM and scale-back in one call per layer.

ctypes releases the GIL for the call. The C code trusts its arguments, so `PackedInt8` checks the
weight when it is packed and `__call__` checks x's dtype, device and layout each call (one layer's
shapes are fixed, so that is a few comparisons).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from worker.kernels.build import build_or_none

SOURCE = Path(__file__).with_name("int8_linear.c")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Int8LinearKernel:
    """The library: `pack` a weight once, then call the `PackedInt8` it returns; `isa` names the
    vector code it was compiled to (avx512_vnni, avx2 or portable)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.int8_linear_isa.restype = ctypes.c_char_p
        self.isa: str = lib.int8_linear_isa().decode()
        lib.int8_linear_tile.restype = _i64
        self.tile: int = lib.int8_linear_tile()
        lib.int8_packed_bytes.argtypes = [_i64, _i64]
        lib.int8_packed_bytes.restype = _i64
        lib.int8_pack.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr]
        lib.int8_pack.restype = None
        lib.int8_linear.argtypes = [
            *(_ptr, _i64, _i64, _i64),  # x, its rows, inner size, row stride
            *(_ptr, _ptr, _ptr, _ptr, _i64),  # the packed weight, its column corrections, scales, bias, columns
            *(_ptr, _i64, ctypes.c_int, ctypes.c_int),  # out, its row stride, GELU, threads
        ]
        lib.int8_linear.restype = ctypes.c_int
        self._lib = lib

    def pack(self, values: Tensor, scales: Tensor, bias: Tensor | None) -> PackedInt8:
        """A weight [k, n] int8 (within [-127, 127]) with its column scales [n] float32 and bias [n]."""
        if values.dtype != torch.int8 or values.dim() != 2 or not values.is_cpu or values.stride(1) != 1:
            raise ValueError(f"int8 pack: a CPU int8 [k, n] weight with unit column stride, not {values.dtype}")
        k, n = values.shape
        for name, vector in (("scales", scales), ("bias", bias)):
            if vector is not None and (vector.dtype != torch.float32 or tuple(vector.shape) != (n,)):
                raise ValueError(f"int8 pack: {name} must be float32 [{n}]")
        packed = torch.empty(self._lib.int8_packed_bytes(k, n), dtype=torch.int8)
        n_pad = -(-n // self.tile) * self.tile
        corr = torch.empty(n_pad, dtype=torch.int32)
        self._lib.int8_pack(values.data_ptr(), k, n, values.stride(0), packed.data_ptr(), corr.data_ptr())
        bias = None if bias is None else bias.detach().contiguous()
        return PackedInt8(self, k, n, packed, corr, scales.contiguous(), bias)


class PackedInt8:
    """One layer's weight in the kernel's order: `layer(x)` = x [m, k] float32 @ W + bias, and
    `layer(x, gelu=True)` GPT-2's GELU of it (its tanh approximation), applied in the same call."""

    __slots__ = ("_kernel", "k", "n", "_packed", "_corr", "_scales", "_bias", "_fn", "_args")

    def __init__(
        self,
        kernel: Int8LinearKernel,
        k: int,
        n: int,
        packed: Tensor,
        corr: Tensor,
        scales: Tensor,
        bias: Tensor | None,
    ) -> None:
        self.k, self.n = k, n
        # Kept alive: the library, and the tensors whose addresses the calls pass.
        self._kernel, self._packed, self._corr, self._scales, self._bias = kernel, packed, corr, scales, bias
        self._fn = kernel._lib.int8_linear
        bias_ptr = None if bias is None else bias.data_ptr()
        self._args = (packed.data_ptr(), corr.data_ptr(), scales.data_ptr(), bias_ptr, n)

    def __call__(self, x: Tensor, gelu: bool = False) -> Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or not x.is_cpu:
            raise ValueError(
                f"int8 linear: float32 [m, {self.k}] on the CPU, not {x.dtype} {tuple(x.shape)} {x.device}"
            )
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        if m and self._fn(
            x.data_ptr(), m, self.k, x.stride(0), *self._args, out.data_ptr(), self.n, gelu, torch.get_num_threads()
        ):
            raise MemoryError("int8 linear: no memory for the quantized rows")
        return out


@functools.cache
def cpu_int8_linear() -> Int8LinearKernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built here."""
    return build_or_none(SOURCE, Int8LinearKernel, None)
