"""int8 weights (worker/int8.py, `--quantize int8`): the weight's quantization, a packed layer
against float32, the refusal where the kernel cannot be built, the refusals of `load`, and the
engine serving every request with them (the kernel itself: test_int8_kernel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine_run import run_with_late_arrivals
from tests.unit.worker.test_engine import CPU, assert_starts_alike, make_engine
from worker import int8
from worker.errors import ModelLoadError
from worker.loading import LoadedModel, load, resolve_dtype

needs_int8 = pytest.mark.skipif(int8.unsupported() is not None, reason=f"int8: {int8.unsupported()}")


def test_a_weight_is_quantized_per_output_column_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 48)  # columns of very different ranges
    weight[:, 5] = 0.0
    q = int8.Int8Weight.of(weight)
    assert q.values.dtype == torch.int8 and q.values.shape == (64, 48) and q.scales.shape == (48,)
    assert int(q.values.abs().max()) == 127  # each column's largest magnitude maps to 127
    dequantized = q.values.float() * q.scales
    assert bool(((dequantized - weight).abs() <= q.scales / 2 + 1e-7).all())
    assert bool((dequantized[:, 5] == 0).all())


@needs_int8
def test_a_packed_layer_is_within_a_percent_or_two_of_float32() -> None:
    torch.manual_seed(1)
    for rows in (1, 7, 32):
        x = torch.randn(rows, 96)
        weight, bias = torch.randn(96, 40) * 0.05, torch.randn(40)
        reference = x @ weight + bias
        got = int8.pack(weight, bias)(x)
        assert got.dtype == torch.float32 and got.shape == reference.shape
        assert float((got - reference).abs().max()) <= 0.02 * float(reference.abs().max())
        unbiased = int8.pack(weight, None)(x)
        assert torch.allclose(unbiased + bias, got, atol=1e-5)


def test_without_a_kernel_int8_is_unsupported_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8, "cpu_int8_linear", lambda: None)
    why = int8.unsupported()
    assert why is not None and "C compiler" in why
    assert int8.isa() == "none"
    with pytest.raises(RuntimeError, match="C compiler"):
        int8.pack(torch.zeros(4, 4), None)


def test_load_refuses_int8_where_it_cannot_run_never_falling_back(
    tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelLoadError, match="--quantize int8: .*--dtype float32"):
        load(str(tiny_gpt2_dir), CPU, torch.bfloat16, "int8")
    with pytest.raises(ModelLoadError, match="--quantize int8: .*cpu, not cuda"):
        load(str(tiny_gpt2_dir), torch.device("cuda"), torch.float32, "int8")
    monkeypatch.setattr(int8, "unsupported", lambda: "no kernel here")
    with pytest.raises(ModelLoadError, match="--quantize int8: no kernel here"):
        load(str(tiny_gpt2_dir), CPU, torch.float32, "int8")
    assert resolve_dtype("auto", CPU, "int8") == torch.float32


@needs_int8
def test_the_engine_serves_every_request_with_int8_weights_and_starts_as_float32_does(
    tiny_gpt2_dir: Path, loaded: LoadedModel
) -> None:
    # As with bfloat16, free-running greedy streams part at the first near-tie; only the first
    # tokens are compared here.
    reference = run_with_late_arrivals(make_engine(loaded))
    quantized = load(str(tiny_gpt2_dir), CPU, torch.float32, "int8")
    layer = quantized.model.transformer.blocks[0].mlp.c_fc
    assert layer.int8 is not None and layer.weight is None and layer.packed is None
    assert quantized.model.lm_head_int8 is not None and quantized.model.lm_head_packed is None
    assert_starts_alike(run_with_late_arrivals(make_engine(quantized)), reference)
