from __future__ import annotations

import asyncio
from typing import Any

import pytest

import governor.shell.supervisor as supervisor_module
from governor.shell.supervisor import WorkerSupervisor


class FakeProcess:
    pid = 4242
    returncode = None

    def __init__(self) -> None:
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await self._exit

    def terminate(self) -> None:
        if not self._exit.done():
            self._exit.set_result(0)


def test_a_failed_spawn_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "BACKOFF_MIN_S", 0.01)
    attempts: list[int] = []

    async def fake_exec(*argv: Any, **kwargs: Any) -> FakeProcess:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("fork failed")
        return FakeProcess()

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)

    async def main() -> list[int]:
        spawned: list[int] = []
        sup = WorkerSupervisor("unix:/tmp/w.sock", [], spawned.append, lambda: None)
        sup.start()
        for _ in range(200):
            if spawned:
                break
            await asyncio.sleep(0.01)
        await sup.stop(timeout_s=1)
        return spawned

    assert asyncio.run(main()) == [4242]
    assert len(attempts) == 2


class ExitingProcess(FakeProcess):
    """A worker that exits with `code` at once, having written `said` to its exit report."""

    def __init__(self, code: int, report: Any, said: str) -> None:
        super().__init__()
        if said:
            report.write_text(said + "\n")
        self._exit.set_result(code)


@pytest.mark.parametrize(("code", "said", "wait_s", "cause"), [
    (2, "--model '/x': no such directory", supervisor_module.STARTUP_RETRY_S, "--model '/x': no such directory"),
    (1, "RuntimeError: boom", 0.01, "RuntimeError: boom"),
    (-9, "", 0.01, "killed by SIGKILL"),
])  # fmt: skip
def test_a_worker_that_cannot_start_waits_minutes_and_its_reason_is_passed_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, code: int, said: str, wait_s: float, cause: str
) -> None:
    monkeypatch.setattr(supervisor_module, "BACKOFF_MIN_S", 0.01)
    report = tmp_path / "worker-0.exit"
    envs: list[dict[str, str]] = []

    async def fake_exec(*argv: Any, **kwargs: Any) -> FakeProcess:
        envs.append(kwargs["env"])
        return ExitingProcess(code, report, said)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)

    async def main() -> list[supervisor_module.WorkerExit]:
        exits: list[supervisor_module.WorkerExit] = []
        sup = WorkerSupervisor("unix:/tmp/w.sock", [], lambda pid: None, lambda: None, None, exits.append, report)
        sup.start()
        while len(exits) < 2:
            await real_sleep(0.001)
        await sup.stop(timeout_s=1)
        return exits

    exits = asyncio.run(main())
    assert [e.code for e in exits[:2]] == [code, code] and exits[0].cause == cause
    assert slept[0] == wait_s  # a start-up error is not retried in the crash loop
    assert exits[0].restart_in_s == wait_s and cause in str(exits[0])
    assert envs[0]["GOVERNOR_WORKER_EXIT_REPORT"] == str(report)
