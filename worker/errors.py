"""The worker's own start-up error, in a module without torch: the CLI catches it for every engine,
and the echo engine must start without importing torch (about 2 s of a 2-core machine's CPU)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model named by --model cannot be loaded (missing, not GPT-2, unreadable)."""
