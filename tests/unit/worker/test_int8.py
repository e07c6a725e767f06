"""int8 weights (worker/int8.py, `--quantize int8`): the weight's quantization, the int8 linear
against float32, the start-up probe that refuses a CPU whose int8 GEMM is wrong, the refusals of
`load`, and the engine serving every request with them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine_run import PROMPTS, run_with_late_arrivals
from tests.unit.worker.test_engine import CPU, make_engine
from worker import int8
from worker.errors import ModelLoadError
from worker.loading import LoadedModel, load, resolve_dtype

needs_int8 = pytest.mark.skipif(int8.unsupported() is not None, reason=f"int8 GEMM: {int8.unsupported()}")


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    int8.unsupported.cache_clear()
    yield
    int8.unsupported.cache_clear()


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
def test_the_int8_linear_is_within_a_percent_or_two_of_float32() -> None:
    torch.manual_seed(1)
    for rows in (1, 7, 32):
        x = torch.randn(rows, 96)
        weight, bias = torch.randn(96, 40) * 0.05, torch.randn(40)
        reference = x @ weight + bias
        got = int8.linear(x, int8.Int8Weight.of(weight), bias)
        assert got.dtype == torch.float32 and got.shape == reference.shape
        assert float((got - reference).abs().max()) <= 0.02 * float(reference.abs().max())
        unbiased = int8.linear(x, int8.Int8Weight.of(weight), None)
        assert torch.allclose(unbiased + bias, got, atol=1e-5)


def test_a_gemm_that_overflows_without_vnni_is_refused_naming_it(
    fresh_probe: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What oneDNN's int8 GEMM does without VNNI: the activations shifted to unsigned (+128), pairs of
    products summed by `vpmaddubsw` into int16, saturated, the shift taken off after. (The probe
    itself refuses the real thing: ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI machine.)"""

    def int16_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shifted = a.int() + 128
        products = shifted.unsqueeze(2) * b.int().unsqueeze(0)  # [M, K, N]
        pairs = products.view(a.shape[0], -1, 2, b.shape[1]).sum(2).clamp(-32768, 32767)
        return (pairs.sum(1) - 128 * b.int().sum(0)).int()

    monkeypatch.setattr(torch, "_int_mm", int16_pairs)
    why = int8.unsupported()
    assert why is not None and "VNNI" in why


def test_load_refuses_int8_where_it_cannot_run_never_falling_back(
    tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelLoadError, match="--quantize int8: .*--dtype float32"):
        load(str(tiny_gpt2_dir), CPU, torch.bfloat16, "int8")
    with pytest.raises(ModelLoadError, match="--quantize int8: .*cpu, not cuda"):
        load(str(tiny_gpt2_dir), torch.device("cuda"), torch.float32, "int8")
    monkeypatch.setattr(int8, "unsupported", lambda: "no VNNI here")
    with pytest.raises(ModelLoadError, match="--quantize int8: no VNNI here"):
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
    finished = run_with_late_arrivals(make_engine(quantized))
    for rid, _, n in PROMPTS:
        ours, theirs = finished[rid].seq.output_ids, reference[rid].seq.output_ids
        assert ours[0] == theirs[0], rid
        assert len(ours) == n or finished[rid].completion.finish_reason == "eos"
