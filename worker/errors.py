"""The worker's own start-up errors, in a module without torch: the CLI catches them for every engine,
and the echo engine must start without importing torch (about 2 s of a 2-core machine's CPU)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model named by --model cannot be loaded (missing, not GPT-2, unreadable)."""


class StartupError(Exception):
    """The command line cannot be read (an unknown flag, a bad value): argparse's usage error."""
