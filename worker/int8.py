"""int8 weights for GPT-2's linear layers and its LM head on the CPU (`--quantize int8`).

Each weight is stored once as int8, symmetric per output channel (its own scale: the column's
largest magnitude over 127); each call's activations are quantized per row on the fly (dynamic
quantization, as llama.cpp quantizes a Q8_0 matmul's activations), multiplied in int32 and scaled
back to float32 with the bias added (and the MLP's GELU after it), all in one call of the C kernel
(worker/kernels/int8_linear.c: AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw` with the sign moved onto
the weights so that no pair saturates, or portable C), on a weight packed at load in the order its
vector loop reads it.

The LM head is int8 too, from its own copy of the tied embedding (the embedding the inputs look up
stays float32). Measured both ways on a 2-core Zen 4, GPT-2 small at batch 32: the decode step
took 18.1 ms with it against 27.3 ms with it in float32 (32 x 768 x 50,257: 3.9 against 13.6 ms).
The cost, on the trained model's held-out text: perplexity 0.9994x float32's with it, 1.0001x
without (llama.cpp's Q8_0, whose activation scales cover 32 values rather than a row: 1.0001x);
teacher-forced top-1 agreement with float32 99.6% either way.

Why a kernel of our own rather than a library (measured on that CPU, batch 32, 2 threads; the
figures are in docs/BENCHMARKS.md): `torch._int_mm` (what torchao's
`Int8DynamicActivationInt8WeightConfig` dispatches to on the CPU) reorders the weight on every call
and leaves the quantization and the scale-back to separate passes; without VNNI its oneDNN GEMM
saturates int16 pair sums and is silently wrong for full-range weights. The old
`torch.ao.quantization` dynamic linear is deprecated (pytorch/ao#2259) and quantizes activations
per tensor: one request's outlier would move every other request's rounding.

Where the kernel cannot be built (no C compiler), `--quantize int8` is refused at start naming why,
never run quietly in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from worker.kernels.int8_linear import PackedInt8, cpu_int8_linear


def unsupported() -> str | None:
    """Why int8 layers cannot run here (None: they can)."""
    if cpu_int8_linear() is None:
        return "its C kernel cannot be built here (the log says why): it needs a C compiler (cc, gcc or clang)"
    return None


def isa() -> str:
    """The vector code the int8 kernel runs here (avx512_vnni, avx2 or portable), for the logs."""
    kernel = cpu_int8_linear()
    return "none" if kernel is None else kernel.isa


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A linear layer's weight [in, out] as int8 and the scale of each output column."""

    values: Tensor  # [in, out] int8
    scales: Tensor  # [out] float32: a column's weights are values x its scale

    @classmethod
    def of(cls, weight: Tensor) -> Int8Weight:
        """Symmetric per output column: its largest magnitude maps to 127 (a zero column to 0)."""
        weight = weight.float()
        scales = weight.abs().amax(dim=0).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        values = torch.round(weight / scales).clamp_(-127, 127).to(torch.int8)
        return cls(values.contiguous(), scales.contiguous())


def pack(weight: Tensor, bias: Tensor | None) -> PackedInt8:
    """`weight` [in, out] (and `bias` [out]) quantized and packed: call the result on x [n, in]
    float32 for x @ weight + bias."""
    kernel = cpu_int8_linear()
    if kernel is None:
        raise RuntimeError(f"int8 weights: {unsupported()}")
    quantized = Int8Weight.of(weight.detach())
    return kernel.pack(quantized.values, quantized.scales, None if bias is None else bias.detach().float())
