"""Waiting on real processes: poll a condition until a deadline; on a timeout, say what was awaited
and show the end of the process's log, which usually says why."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, log: Path, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; {log.name}:\n{log.read_text()[-4000:]}")
