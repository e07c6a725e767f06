"""The worker's malloc settings: a step's freed activations are reused, not faulted in again."""

from __future__ import annotations

import resource

import pytest
import torch

from worker.allocator import keep_freed_memory


def test_freed_activation_sized_buffers_come_back_without_page_faults() -> None:
    if not keep_freed_memory():
        pytest.skip("not glibc: no mallopt")
    for _ in range(2):  # the first rounds map the pages once
        torch.empty(5 << 20).fill_(1.0)  # 20 MiB, a prefill projection's size
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(5):
        torch.empty(5 << 20).fill_(1.0)
    # 20 MiB is 5,120 pages: faulting it in again every time would be 25,600 faults
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 500
