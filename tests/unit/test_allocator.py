"""The worker's malloc settings: a step's freed activations are reused, not faulted in again.

Each case runs in a fresh interpreter, as the worker does: the settings are applied at start, and
the heap of a long-lived test process (fragmented by every test before) says nothing about them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.allocator import keep_freed_memory

# Prefill steps of GPT-2 small at varying prompt lengths: each allocates its qkv, MLP and output
# activations (3-18 MiB each), frees them, and the next step asks for other sizes.
STEPS = """
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from worker.allocator import keep_freed_memory
    assert keep_freed_memory()
def step(tokens):
    buffers = [torch.empty(tokens, width).fill_(1.0) for width in (3 * 768, 3072, 768)]
    del buffers
lengths = [512, 1024, 1536, 2048, 700, 1900]
for tokens in lengths:  # the first round maps the pages once
    step(tokens)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    for tokens in lengths:
        step(tokens)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_after_warm_up(mode: str) -> int:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode], cwd=root, capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.strip())


def test_freed_activations_come_back_without_page_faults() -> None:
    if not keep_freed_memory():
        pytest.skip("not glibc: no mallopt")
    # glibc's defaults hand the larger buffers back and map them again: thousands of faults a round
    assert faults_after_warm_up("default") > 3_000
    assert faults_after_warm_up("keep") < 300
