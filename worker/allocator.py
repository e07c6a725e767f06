"""glibc malloc settings for the engine: keep freed activation memory instead of handing it back.

Every step allocates and frees the same large activations (a 2,048-token prefill step: 19-25 MB
per projection, per layer). By default glibc gives freed memory at the top of a heap back to the
kernel and serves requests above a moving threshold with fresh mappings, so the next step faults
the same pages in again, zeroed by the kernel: about 150,000 faults and 0.5-1.8 s of system time
in one GPT-2 small prefill step on the 2-core test machine, 208,000-237,000 faults per run of the
benchmark's mixed workload. Fixed thresholds keep those pages for the next step: the mixed
workload went from 74.5-80.6 to 83.1-86.5 tokens/s (4 runs each, faults per run ~0). Nothing is
lost: RSS stays at one step's peak of activations, which the next step reuses.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
# Requests from 32 MiB up (glibc's largest threshold) still get their own mapping: the KV cache,
# allocated once, is one; a step's activations are below it.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Apply the settings, process-wide; False where the C library has no glibc `mallopt`."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
