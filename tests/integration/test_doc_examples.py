"""The README's and docs/client.md's code, run as written against what `make run` starts: its
defaults (the GPT-2 worker with random weights, --max-inflight 32), with the front door on, after
its `event=ready` line. Only the ports are changed, to free ones (and `$GOVERNOR_ADDRESS` points
the address-less `Client()` at them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from benchmarks.harness.fixtures.redis_server import free_ports
from tests.integration.conftest import Governor
from tests.polling import wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "client.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


class Running(NamedTuple):
    port: int
    http_port: int
    log: Path


def blocks() -> list[tuple[str, str]]:
    return [
        (f"{path.relative_to(ROOT)}#{i}", code)
        for path in DOCS
        for i, code in enumerate(FENCE.findall(path.read_text()), start=1)
    ]


@pytest.fixture(scope="module")
def make_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """`make run ARGS="--http-port 8080"`, on free ports."""
    port, metrics_port, http_port = free_ports(3)
    log = tmp_path_factory.mktemp("make-run") / "governor.log"
    argv = [sys.executable, "-m", "governor", "serve", "--port", str(port), "--metrics-port", str(metrics_port)]
    with log.open("wb") as out:
        proc = subprocess.Popen([*argv, "--http-port", str(http_port)], stdout=out, stderr=subprocess.STDOUT)
    governor = Governor(proc, port, metrics_port, log)
    try:
        # What the README tells a newcomer to wait for.
        wait_until(lambda: "event=ready" in log.read_text() or proc.poll() is not None, 90, "event=ready", log)
        assert proc.poll() is None, log.read_text()
        yield Running(port, http_port, log)
    finally:
        governor.stop(30)


def run(code: str, where: Running, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    code = code.replace("7070", str(where.port)).replace("8080", str(where.http_port))
    env = {**os.environ, "GOVERNOR_ADDRESS": f"127.0.0.1:{where.port}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


def test_the_docs_have_the_examples_this_runs() -> None:
    names = [name for name, _ in blocks()]
    assert len([n for n in names if n.startswith("README")]) >= 2 and len(names) >= 5, names


@pytest.mark.parametrize(("name", "code"), blocks(), ids=[name for name, _ in blocks()])
def test_each_python_example_runs_as_written(name: str, code: str, make_run: Running) -> None:
    done = run(code, make_run)
    assert done.returncode == 0, f"{name} failed:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"


def test_the_readme_send_and_metrics_commands_work(make_run: Running) -> None:
    send = subprocess.run(
        [sys.executable, "-m", "governor", "send", "--address", f"127.0.0.1:{make_run.port}", "hello governor"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert send.returncode == 0 and send.stdout.strip(), send.stderr
    status, failures = _status(make_run.port)
    assert status.startswith("governor: serving") and not failures, status  # no request failed, none of it


def _status(port: int) -> tuple[str, str]:
    screen = subprocess.run(
        [sys.executable, "-m", "governor", "status", "--address", f"127.0.0.1:{port}", "--interval", "0.1"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    failures = "".join(line for line in screen.splitlines() if line.startswith("failures"))
    return screen, failures
