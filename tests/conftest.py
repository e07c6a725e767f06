"""Suite-wide settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# Shared 2-core CI machines are noisy: judge properties, not per-example wall time.
settings.register_profile("governor", deadline=None, print_blob=True)
settings.load_profile("governor")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 directory (config, weights, tokenizer) as `save_pretrained` writes it."""
    from benchmarks.harness.fixtures.tiny_gpt2 import save_tiny_gpt2

    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))
