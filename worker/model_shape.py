"""The GPT-2 hyper-parameters the engine needs, read from a transformers `GPT2Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GPT2Shape:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_config(cls, config: Any) -> GPT2Shape:
        """From a `transformers.GPT2Config` (duck-typed so this module needs no transformers)."""
        return cls(
            vocab_size=config.vocab_size,
            n_positions=config.n_positions,
            n_embd=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_inner=config.n_inner or 4 * config.n_embd,
            layer_norm_epsilon=config.layer_norm_epsilon,
        )
