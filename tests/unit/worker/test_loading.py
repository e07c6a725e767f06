"""--dtype: what `auto` resolves to on each kind of machine."""

from __future__ import annotations

import pytest
import torch

import worker.loading as loading
from worker.loading import resolve_dtype, resolve_kv_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_taken_as_is(name: str) -> None:
    assert resolve_dtype(name, CPU) == getattr(torch, name)


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "onednn_bf16", "expected"),
    [
        (False, False, False, torch.float32),  # AVX2 only: bfloat16 would be emulated
        (True, False, True, torch.bfloat16),
        (False, True, True, torch.bfloat16),
        (True, True, False, torch.float32),  # no oneDNN bfloat16 path for the linear layers
    ],
)
def test_auto_on_a_cpu_is_bfloat16_only_where_it_runs_natively(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, onednn_bf16: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(loading, "can_pack_for_cpu", lambda dtype: onednn_bf16)
    assert resolve_dtype("auto", CPU) == expected


def test_auto_on_this_cpu_follows_its_features() -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", CPU) == (
        torch.bfloat16 if native and loading.can_pack_for_cpu(torch.bfloat16) else torch.float32
    )


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_on_cuda_is_bfloat16_or_float16(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    assert resolve_dtype("auto", CUDA) == expected


@pytest.mark.parametrize("native", [True, False])
def test_the_kv_cache_follows_the_model_unless_int8_weights_run_on_a_cpu_with_native_bfloat16(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(loading, "cpu_runs_bfloat16_natively", lambda: native)
    assert resolve_kv_dtype("auto", CPU, torch.float32) == torch.float32
    assert resolve_kv_dtype("auto", CPU, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("auto", CPU, torch.float32, "int8") == (torch.bfloat16 if native else torch.float32)
    assert resolve_kv_dtype("auto", CUDA, torch.float16) == torch.float16
    for name, dtype in loading.DTYPES.items():  # named: as named, whatever the model
        assert resolve_kv_dtype(name, CPU, torch.float32, "int8") == dtype
