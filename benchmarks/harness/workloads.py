"""The prompt sets the engine is measured on, by name: the engine benchmarks (engine_vs_hf, dtypes)
and llama.cpp's side by side (peers/llamacpp) send the same prompts, so their tokens/s compare.

- `uniform`: 32 prompts of 64 characters, 64 new tokens each;
- `mixed`: 32 prompts of 16-512 characters, 8-128 new tokens each;
- `wide`: 256 prompts of 32 characters, 64 new tokens each (issue 45: the host's work per sequence).

Characters are tokens for the random models' byte tokenizer; the seed makes a set the same in
every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    max_new_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_new_tokens)


def make_workload(name: str, seed: int) -> Workload:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      "

    def text(n: int) -> str:  # n ASCII characters: n tokens for the byte tokenizer of the random models
        return "".join(rng.choice(alphabet) for _ in range(n))

    if name == "uniform":
        return Workload(name, [text(64) for _ in range(32)], [64] * 32)
    if name == "wide":  # issue 45: 256 streams at once, where the host's work per sequence shows
        return Workload(name, [text(32) for _ in range(256)], [64] * 256)
    if name == "mixed":
        lengths = [rng.randint(16, 512) for _ in range(32)]
        return Workload(name, [text(n) for n in lengths], [rng.randint(8, 128) for _ in range(32)])
    raise SystemExit(f"unknown workload {name!r}; expected uniform, mixed or wide")
