"""The C argmax (worker/kernels/argmax.c) against torch.argmax, on every vector code and dtype."""

from __future__ import annotations

import functools
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.kernels.argmax import SOURCE, ArgmaxKernel, cpu_argmax
from worker.kernels.build import build

# The code each kind of CPU gets, built here by taking features away from -march=native.
VARIANTS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2",)}


@functools.cache
def variant(name: str) -> ArgmaxKernel:
    if name != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variants are x86-64 feature sets")
    return ArgmaxKernel(build(SOURCE, VARIANTS[name]))


SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.0]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(list(VARIANTS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 1000]),
    ties=st.booleans(),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_is_torch_argmax(
    name: str,
    dtype: torch.dtype,
    rows: int,
    vocab: int,
    ties: bool,
    specials: list[tuple[int, float]],
    seed: int,
) -> None:
    """Ties (a few distinct values: the first index wins), NaN (the first NaN wins), infinities,
    signed zeros, rows shorter than a vector and vector tails, on a strided view of wider rows."""
    kernel = variant(name)
    if dtype not in kernel.dtypes:
        pytest.skip(f"the compiler has no {dtype}")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab + 3, generator=g)[:, :vocab]
    if ties:
        logits = logits.round()
    for at, value in specials:
        logits[at % rows, (at // rows) % vocab] = value
    logits = logits.to(dtype)
    assert torch.equal(kernel(logits), logits.float().argmax(dim=-1))


def test_the_kernel_refuses_what_it_cannot_read() -> None:
    kernel = cpu_argmax()
    assert kernel is not None, "the test machine has a C compiler"
    with pytest.raises(ValueError, match="no kernel"):
        kernel(torch.randn(2, 8).double())
    with pytest.raises(ValueError, match="no kernel"):
        kernel(torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="rows of 0"):
        kernel(torch.empty(2, 0))
    assert kernel(torch.empty(0, 5)).shape == (0,)
