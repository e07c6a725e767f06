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

# A step's activations (24, 4 and 16 MiB: a prefill's projections), allocated, written and freed.
# What the frees hand back to the kernel is what the next step would fault in again.
STEP = """
import sys, torch
if sys.argv[1] == "keep":
    from worker.allocator import keep_freed_memory
    assert keep_freed_memory()
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
buffers = [torch.empty(mib << 18).fill_(1.0) for mib in (24, 4, 16)]
held = rss_kib()
del buffers
print(held - rss_kib())
"""


def kib_handed_back(mode: str) -> int:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", STEP, mode], cwd=root, capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.strip())


def test_freed_activations_stay_mapped_for_the_next_step() -> None:
    if not keep_freed_memory():
        pytest.skip("not glibc: no mallopt")
    # glibc's defaults serve each buffer from its own mapping and unmap it when it is freed
    assert kib_handed_back("default") > 40 << 10
    assert kib_handed_back("keep") < 1 << 10
