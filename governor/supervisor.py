"""Spawns the local worker process and restarts it when it exits.

The worker runs in its own session so a terminal's Ctrl-C reaches only the governor, which drains
first and then stops the worker; the worker also exits by itself if the governor disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable

log = logging.getLogger("governor.supervisor")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
STABLE_AFTER_S = 10.0  # a worker that ran this long resets the backoff


class WorkerSupervisor:
    def __init__(
        self,
        listen: str,
        worker_args: list[str],
        on_spawn: Callable[[int], None],
        on_restart: Callable[[], None],
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "worker",
            "serve",
            "--listen",
            listen,
            "--parent-pid",
            str(os.getpid()),
            *worker_args,
        ]
        self._on_spawn = on_spawn
        self._on_restart = on_restart
        self._env = env  # None: the governor's own environment
        self._process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stopping:
            started = time.monotonic()
            try:
                self._process = await asyncio.create_subprocess_exec(*self.argv, start_new_session=True, env=self._env)
            except OSError as exc:
                log.error("event=worker_spawn_failed error=%r retry_in_s=%.2f", exc, backoff)
            else:
                log.info("event=worker_spawned pid=%d", self._process.pid)
                self._on_spawn(self._process.pid)
                code = await self._process.wait()
                if self._stopping:
                    return
                log.warning("event=worker_exited pid=%d code=%d restart_in_s=%.2f", self._process.pid, code, backoff)
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = BACKOFF_MIN_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            self._on_restart()

    def kill(self) -> None:
        """SIGKILL the running worker (declared hung); the loop above then restarts it. Only while
        it has not been reaped, so its pid cannot have been reused."""
        process = self._process
        if process is not None and process.returncode is None:
            log.warning("event=worker_kill pid=%d reason=unresponsive", process.pid)
            process.kill()

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                log.warning("event=worker_kill pid=%d reason=terminate_timeout", process.pid)
                process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
