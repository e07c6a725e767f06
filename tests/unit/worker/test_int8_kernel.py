"""The C int8 linear kernel (worker/kernels/int8_linear.c) on every vector code: exactly the integer
product of the per-row quantized activations and the int8 weight, scaled back, whatever the shapes."""

from __future__ import annotations

import functools
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.int8 import Int8Weight
from worker.kernels.build import KernelUnavailable, build
from worker.kernels.int8_linear import SOURCE, Int8LinearKernel

# The code each kind of CPU gets, built here by taking features away from -march=native.
VARIANTS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2",)}


@functools.cache
def variant(name: str) -> Int8LinearKernel:
    if name != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variants are x86-64 feature sets")
    try:
        return Int8LinearKernel(build(SOURCE, VARIANTS[name]))
    except KernelUnavailable as exc:
        pytest.skip(f"no kernel here: {exc}")


def reference(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The same arithmetic in exact integers (int64) and float64: what the kernel must give, up to
    float32 rounding of the scale-back."""
    scales = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(x * (1.0 / scales)).clamp(-127, 127).to(torch.int64)
    product = (q @ weight.values.to(torch.int64)).double()
    out = product * (scales.double() * weight.scales.double())
    return out if bias is None else out + bias.double()


@settings(max_examples=120, deadline=None)
@given(
    name=st.sampled_from(list(VARIANTS)),
    rows=st.integers(0, 9),
    k=st.sampled_from([1, 3, 4, 5, 31, 64, 100, 257]),
    n=st.sampled_from([1, 7, 16, 33, 64, 65, 130]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_is_the_integer_product_scaled_back(
    name: str, rows: int, k: int, n: int, with_bias: bool, seed: int
) -> None:
    """Rows not a multiple of the kernel's 4, inner sizes not a multiple of 4 or of a vector, columns
    not a whole tile, zero rows, on a strided view of wider rows."""
    kernel = variant(name)
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, k + 3, generator=g) * torch.rand(rows, 1, generator=g) * 10
    x = wide[:, 1 : k + 1]  # rows k + 3 apart
    if rows > 1:
        x[1] = 0.0  # a zero row: its scale is the smallest normal float, its output the bias
    weight = Int8Weight.of(torch.randn(k, n, generator=g))
    bias = torch.randn(n, generator=g) if with_bias else None
    got = kernel.pack(weight.values, weight.scales, bias)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    expected = reference(x, weight, bias)
    largest = float(expected.abs().max()) if expected.numel() else 1.0
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * largest)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_full_range_products_do_not_saturate(name: str) -> None:
    """127 x 127 in every pair: past int16, where `vpmaddubsw` saturates (oneDNN's AVX2 int8 GEMM
    gets this wrong for full-range weights); the AVX2 path moves the sign onto the weights instead."""
    kernel = variant(name)
    k, n = 768, 32
    x = torch.full((3, k), 5.0)
    x[1] = -5.0
    values = torch.full((k, n), 127, dtype=torch.int8)
    values[:, 1::2] = -127
    layer = kernel.pack(values, torch.ones(n), None)
    got = layer(x)
    full = 127 * 127 * k * (5.0 / 127.0)
    expected = torch.tensor([full, -full]).repeat(n // 2)
    assert torch.equal(got[0], expected) and torch.equal(got[1], -expected) and torch.equal(got[2], expected)


def test_the_kernel_refuses_what_it_cannot_take() -> None:
    kernel = variant("native")
    weight = Int8Weight.of(torch.randn(16, 8))
    with pytest.raises(ValueError, match="int8 pack"):
        kernel.pack(weight.values.float(), weight.scales, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bias must be float32"):
        kernel.pack(weight.values, weight.scales, torch.zeros(9))
    layer = kernel.pack(weight.values, weight.scales, None)
    for bad in (torch.zeros(2, 15), torch.zeros(2, 16, dtype=torch.float64), torch.zeros(16)):
        with pytest.raises(ValueError, match="int8 linear"):
            layer(bad)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_fused_gelu_is_gpt2s_gelu_of_the_product(name: str) -> None:
    """Outputs across GELU's whole range (large negative, near zero, large positive) and a row tail
    shorter than a vector: as torch's tanh-approximated GELU of the plain product, to float32 rounding."""
    kernel = variant(name)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 96, generator=g) * 3
    weight = Int8Weight.of(torch.randn(96, 77, generator=g))
    bias = torch.linspace(-40, 40, 77)
    layer = kernel.pack(weight.values, weight.scales, bias)
    plain = layer(x)
    fused = layer(x, gelu=True)
    expected = torch.nn.functional.gelu(plain.double(), approximate="tanh")
    assert torch.allclose(fused.double(), expected, rtol=1e-5, atol=1e-5)
    assert float(plain.min()) < -10 and float(plain.max()) > 10  # the range is covered
