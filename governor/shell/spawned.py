"""The workers the governor spawns itself (no --worker given): where they listen, what they are
called, the secret they demand, and one supervisor each (supervisor.py) that restarts them.

Their sockets live in a fresh directory of mode 0700, so no other user can connect; each accepts
only links that present this run's secret, passed in its environment. An endpoint's name is its
metrics label, `spawned-N`, stable across restarts (the directory is new each run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from governor.admission.endpoint import EndpointLimits
from governor.links.worker_link import WorkerLink
from governor.shell.supervisor import WorkerExit, WorkerSupervisor
from govwire.address import Address
from govwire.auth import SharedSecret
from govwire.vocab import WORKER_TOKEN_ENV

SPAWNED = "spawned-"  # a spawned worker's endpoint name: spawned-0, spawned-1, ...


class SpawnedWorkers:
    """`count` local workers, run with `worker_args` after the governor's own `--log-format`."""

    def __init__(self, count: int, worker_args: tuple[str, ...], log_format: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="governor-"))  # mode 0700: the sockets are ours alone
        self.addresses = [Address(path=str(self._dir / f"worker-{i}.sock")) for i in range(count)]
        self.names = [f"{SPAWNED}{i}" for i in range(count)]
        self.secret = SharedSecret.generate()
        # The worker logs as the governor does, unless its own flags (after --) say otherwise.
        self._args = ["--log-format", log_format, *worker_args]

    @property
    def specs(self) -> list[tuple[Address, EndpointLimits]]:
        return [(address, EndpointLimits()) for address in self.addresses]

    def remove(self) -> None:
        """The directory and what is left in it (after the workers stopped)."""
        shutil.rmtree(self._dir, ignore_errors=True)

    def start(self, links: list[WorkerLink], on_restart: Callable[[], None], stack: contextlib.AsyncExitStack) -> None:
        """One supervisor per link's worker, each stopped by `stack`."""
        devices = gpu_assignment(len(links), os.environ.get("CUDA_VISIBLE_DEVICES"))
        for i, (link, device) in enumerate(zip(links, devices, strict=True)):
            supervisor = self._supervise(link, device, on_restart, self._dir / f"worker-{i}.exit")
            stack.push_async_callback(supervisor.stop)

    def _supervise(
        self, link: WorkerLink, device: str | None, on_restart: Callable[[], None], report: Path
    ) -> WorkerSupervisor:
        def on_spawn(pid: int) -> None:
            link.pid = pid

        def on_exit(ended: WorkerExit) -> None:
            link.exited = str(ended)  # /readyz and `stats` say why it is down, until it is up again

        env = {**os.environ, WORKER_TOKEN_ENV: self.secret.token.decode()}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        supervisor = WorkerSupervisor(link.address, self._args, on_spawn, on_restart, env, on_exit, report)
        link.kill_worker = supervisor.kill
        supervisor.start()
        return supervisor


def gpu_assignment(workers: int, visible: str | None) -> list[str | None]:
    """One GPU per spawned worker when there are several: worker i sees the i-th visible device
    (of CUDA_VISIBLE_DEVICES when set, else GPU i), round-robin if there are fewer devices. A
    single worker keeps the environment as it is."""
    if workers == 1:
        return [None]
    if visible is None:
        devices = [str(i) for i in range(workers)]
    else:  # "" hides every GPU: keep it hidden
        devices = [d.strip() for d in visible.split(",") if d.strip()] or [""]
    return [devices[i % len(devices)] for i in range(workers)]
