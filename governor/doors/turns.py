"""The frames connections hold back, answered a bounded number per turn of the event loop over all
of them, so that no number of flooding connections can hold a turn for long.

A connection's core answers the first slice of a read inside `data_received` (at most
`FRAMES_PER_TURN` frames) and holds the rest; a connection whose frames keep being refused (a
client that ignores its hints, a storm) answers nothing there and holds every frame. Either way the
connection joins this queue, unread meanwhile. Each turn the queue answers at most
`FRAMES_PER_TURN` frames in all, connection after connection in the order they joined, a
connection still holding frames going to the back. What runs between those turns (the worker
links' reads with their tokens, the reads of connections whose frames are admitted) waits for one
such slice at most, however many connections storm: before this queue, every storming
connection's read ran in the same turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

log = logging.getLogger("governor.protocol")

FRAMES_PER_TURN = 64
"""Frames decided per turn of the event loop, by one connection's read and by the queue. At ~4 µs
a refused frame, ~0.25 ms of the loop."""


class Sliced(Protocol):
    """A connection as the queue drives it."""

    @property
    def held_frames(self) -> int: ...

    def next_slice(self, budget: int) -> tuple[int, bool]:
        """Answer up to `budget` held frames: how many it answered, and whether more are held."""

    def close(self) -> None: ...


class TurnQueue:
    """Connections holding frames, served `FRAMES_PER_TURN` frames per turn of the running loop."""

    __slots__ = ("_waiting", "_loop")

    def __init__(self) -> None:
        self._waiting: deque[Sliced] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # while a turn is scheduled on it

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, connection: Sliced) -> None:
        """`connection` holds frames: it gets its slices in later turns (the caller adds it once
        per stretch of holding)."""
        self._waiting.append(connection)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        waiting = self._waiting
        budget = FRAMES_PER_TURN
        try:
            for _ in range(len(waiting)):  # each at most once a turn
                connection = waiting[0]
                if budget < min(connection.held_frames, FRAMES_PER_TURN):
                    break  # its slice goes whole, first in the next turn: one write for it, not two
                waiting.popleft()
                try:
                    answered, more = connection.next_slice(budget)
                except Exception:
                    # A bug of ours costs that connection (closed, out of the queue), never the
                    # other connections' turns.
                    log.exception("event=internal_error where=turn_queue")
                    connection.close()
                    continue
                budget -= answered
                if more:
                    waiting.append(connection)
        finally:
            if waiting and self._loop is not None:
                self._loop.call_soon(self._turn)
            else:
                self._loop = None
