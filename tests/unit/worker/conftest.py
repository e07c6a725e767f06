"""Fixtures of the engine tests: the tiny checkpoint loaded by the engine and by transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from worker.loading import LoadedModel, load, load_hf_model


@pytest.fixture(scope="module")
def loaded(tiny_gpt2_dir: Path) -> LoadedModel:
    return load(str(tiny_gpt2_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def hf(tiny_gpt2_dir: Path) -> tuple[Any, Any]:
    return load_hf_model(str(tiny_gpt2_dir))
