"""The C argmax (argmax.c) bound through ctypes: greedy tokens from CPU logits in their own dtype."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from worker.kernels.build import build_or_none

SOURCE = Path(__file__).with_name("argmax.c")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class ArgmaxKernel:
    """`kernel(logits)`: torch.argmax(logits, dim=-1) of CPU logits [n, V] (rows contiguous), as
    int64 [n]: the first index of each row's maximum, or of its first NaN."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self.dtypes: dict[torch.dtype, Callable[..., int]] = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            function = getattr(lib, f"argmax_{str(dtype).removeprefix('torch.')}", None)
            if function is not None:  # float16 needs a compiler with _Float16
                function.argtypes = [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]
                function.restype = ctypes.c_int
                self.dtypes[dtype] = function

    def __call__(self, logits: Tensor) -> Tensor:
        function = self.dtypes.get(logits.dtype)
        if function is None or not logits.is_cpu or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError(f"argmax: no kernel for {logits.dtype} {tuple(logits.shape)} on {logits.device}")
        n, vocab = logits.shape
        out = torch.empty(n, dtype=torch.int64)
        if n and function(logits.data_ptr(), n, vocab, logits.stride(0), out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"argmax: rows of {vocab} logits")
        return out


@functools.cache
def cpu_argmax() -> ArgmaxKernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built here."""
    return build_or_none(SOURCE, ArgmaxKernel, "torch")
