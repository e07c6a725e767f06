from __future__ import annotations

import asyncio
from typing import Any

import pytest

import governor.supervisor as supervisor_module
from governor.supervisor import WorkerSupervisor


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
