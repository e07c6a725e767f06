"""Spawns the local worker process and restarts it when it exits.

The worker runs in its own session so a terminal's Ctrl-C reaches only the governor, which drains
first and then stops the worker; the worker also exits by itself if the governor disappears.

A worker that crashed is restarted with a short backoff (0.1 s doubling to 5 s). One that exits
with `EXIT_STARTUP` could not start for a reason a restart will not change (a mistyped flag or
model path): restarting it every few seconds would only burn a core importing torch, so the next
try waits `STARTUP_RETRY_S` — long enough to stop the loop, short enough that a model directory
mounted late is picked up without a restart of the governor. Either way the worker's own reason
(the line it writes to its exit report) is handed to `on_exit`, for /readyz, `stats` and the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from govwire.vocab import EXIT_STARTUP, WORKER_EXIT_REPORT_ENV

log = logging.getLogger("governor.supervisor")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
STABLE_AFTER_S = 10.0  # a worker that ran this long resets the backoff
STARTUP_RETRY_S = 300.0  # after an EXIT_STARTUP: the cause is a setting, not a transient fault
MAX_REPORT_CHARS = 1000


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """How a worker ended: its exit code (negative: the signal that killed it), why as it said
    (or as the code says), and when the next start comes."""

    code: int
    cause: str
    restart_in_s: float

    def __str__(self) -> str:
        kind = "could not start" if self.code == EXIT_STARTUP else "exited"
        return f"worker {kind} (exit code {self.code}): {self.cause}; next start in {self.restart_in_s:g} s"


class WorkerSupervisor:
    def __init__(
        self,
        listen: str,
        worker_args: list[str],
        on_spawn: Callable[[int], None],
        on_restart: Callable[[], None],
        env: dict[str, str] | None = None,
        on_exit: Callable[[WorkerExit], None] = lambda ended: None,
        report: Path | None = None,
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
        self._on_exit = on_exit
        # Where the worker writes why it exited (None: nowhere; the exit code alone says).
        self._report = report
        self._env = dict(os.environ if env is None else env)
        if report is not None:
            self._env[WORKER_EXIT_REPORT_ENV] = str(report)
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
            code = await self._spawn_and_wait(backoff)
            if self._stopping:
                return
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = BACKOFF_MIN_S
            wait_s = STARTUP_RETRY_S if code == EXIT_STARTUP else backoff
            if code is not None:
                self._exited(code, wait_s)
            await asyncio.sleep(wait_s)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            self._on_restart()

    async def _spawn_and_wait(self, backoff: float) -> int | None:
        """Run one worker to its end: its exit code, or None when it could not be spawned."""
        if self._report is not None:
            with contextlib.suppress(FileNotFoundError):
                self._report.unlink()  # a report left by the last one is not this one's
        try:
            self._process = await asyncio.create_subprocess_exec(*self.argv, start_new_session=True, env=self._env)
        except OSError as exc:
            log.error("event=worker_spawn_failed error=%r retry_in_s=%.2f", str(exc), backoff)
            return None
        log.info("event=worker_spawned pid=%d", self._process.pid)
        self._on_spawn(self._process.pid)
        return await self._process.wait()

    def _exited(self, code: int, restart_in_s: float) -> None:
        ended = WorkerExit(code, self._cause(code), restart_in_s)
        level = logging.ERROR if code == EXIT_STARTUP else logging.WARNING
        pid = self._process.pid if self._process is not None else 0
        log.log(
            level, "event=worker_exited pid=%d code=%d restart_in_s=%.2f cause=%s", pid, code, restart_in_s, ended.cause
        )
        self._on_exit(ended)

    def _cause(self, code: int) -> str:
        """The worker's own line, else what its exit code says."""
        if self._report is not None:
            try:
                said = self._report.read_text(errors="replace").strip()
            except OSError:
                said = ""
            if said:
                return said[:MAX_REPORT_CHARS]
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return "it gave no reason (its own log lines, proc=worker, may)"

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
