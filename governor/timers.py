"""Where deadlines are scheduled, as the layers that set them see it: the event loop
(`loop.call_later`), or a test's fake. A leaf: the lobby (admission) and the lifecycle both set
timers, and neither needs to name the other to do so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Where deadlines are scheduled: the event loop (`loop.call_later`), or a test's fake."""

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Cancellable: ...
