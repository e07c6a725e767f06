"""int8 weights for GPT-2's linear layers on the CPU (`--quantize int8`).

Each layer's weight is stored once as int8, symmetric per output channel (its own scale: the
column's largest magnitude over 127); each step's activations are quantized per row on the fly
(dynamic quantization, as llama.cpp quantizes a Q8_0 matmul's activations), multiplied by
`torch._int_mm` (int8 x int8 -> int32, oneDNN's int8 GEMM: VNNI `vpdpbusd` where the CPU has it),
then scaled back to float32 with the bias added. The LM head stays in float32: at batch 32 the
int8 one was slower (15.5 against 12.9 ms for 32 x 768 x 50,257 on a 2-core Zen 4: scaling 1.6 M
int32 logits back costs more than the GEMM saves), and the embedding it is tied to stays exact.

Why `torch._int_mm` rather than a library: torchao's `Int8DynamicActivationInt8WeightConfig`
dispatches to the same op on the CPU, behind tensor subclasses and a dependency; the old
`torch.ao.quantization` dynamic linear is deprecated (pytorch/ao#2259) and quantizes activations
per tensor. Measured on a 2-core AMD EPYC Zen 4 (avx512_vnni), 2 threads, against the float32
linear on oneDNN's packed weight (worker/model.py) at batch 32: 768 -> 2,304 0.53 -> 0.32 ms,
768 -> 3,072 0.70 -> 0.38 ms, 3,072 -> 768 0.69 -> 0.33 ms, 768 -> 768 0.19 -> 0.15 ms (a layer's
four: 2.10 -> 1.19 ms), relative error of the output 0.5-1%.

Without VNNI, oneDNN's int8 GEMM multiplies pairs with `vpmaddubsw`, whose int16 sums overflow for
weights using the whole int8 range: the results are wrong, silently (found with
`ONEDNN_MAX_CPU_ISA=AVX2`). So support is probed at start with values that overflow there
(`unsupported`), and `--quantize int8` on such a CPU is refused at start naming why, never run
wrong nor quietly in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

_PROBE_K = 768
"""Inner size of the start-up probe: 127 x 127 x 768 sums pairs past int16 where `vpmaddubsw` does."""


@cache
def unsupported() -> str | None:
    """Why int8 linear layers cannot run on this CPU (None: they can): no oneDNN, no `torch._int_mm`,
    or an int8 GEMM that gets a full-range product wrong (no VNNI)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    int_mm = getattr(torch, "_int_mm", None)
    if int_mm is None:
        return "this torch has no torch._int_mm"
    a = torch.full((2, _PROBE_K), 127, dtype=torch.int8)
    b = torch.full((_PROBE_K, 16), 127, dtype=torch.int8)
    b[:, 1::2] = -127
    got = int_mm(a, b)
    expected = torch.tensor([127 * 127 * _PROBE_K, -127 * 127 * _PROBE_K], dtype=torch.int32).repeat(8)
    if not torch.equal(got, expected.expand(2, 16)):
        isa = torch.backends.cpu.get_cpu_capability()
        return (
            f"oneDNN's int8 GEMM on this CPU (capability {isa}) gets full-range int8 products wrong:"
            " it needs AVX512-VNNI or AVX-VNNI"
        )
    return None


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


def linear(x: Tensor, weight: Int8Weight, bias: Tensor | None) -> Tensor:
    """x [N, in] float32 @ weight + bias, as float32: x quantized per row (its largest magnitude
    to 127), the product in int32, scaled back by the row's and the column's scales."""
    row_scales = x.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).div_(127.0)
    quantized = torch.round(x / row_scales).to(torch.int8)
    product = torch._int_mm(quantized, weight.values).float()
    scale = row_scales * weight.scales
    if bias is None:
        return product.mul_(scale)
    return torch.addcmul(bias, product, scale)
