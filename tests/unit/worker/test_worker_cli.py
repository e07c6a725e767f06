"""`worker serve` that cannot start: one log line tagged proc=worker, its exit report for the
governor that spawned it, exit code 2, and no torch imported for a mistyped model path."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from govwire.vocab import EXIT_STARTUP, WORKER_EXIT_REPORT_ENV
from worker.cli import main


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """`main` configures the root logger, as the process it is meant to run in."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--model", "/nonexistent/gpt2"], "--model '/nonexistent/gpt2': no such directory"),
        (["serve", "--modle", "x"], "unrecognized arguments: --modle x"),
        (["serve", "--max-batch-size", "0"], "--max-batch-size must be > 0"),
    ],
)
def test_a_worker_that_cannot_start_says_why_once_and_exits_2(
    argv: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "worker-0.exit"
    monkeypatch.setenv(WORKER_EXIT_REPORT_ENV, str(report))
    assert main(argv) == EXIT_STARTUP == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "level=ERROR" in line]
    assert len(errors) == 1 and "proc=worker" in errors[0] and "event=start_failed" in errors[0]
    assert said in errors[0]
    assert said in report.read_text() and report.read_text().count("\n") == 1


def test_a_mistyped_model_path_fails_before_torch_is_imported() -> None:
    code = (
        "import sys; from worker.cli import main; rc = main(['serve', '--model', '/nonexistent/gpt2']);"
        " print(rc, 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["2", "False"], run.stderr


def test_the_json_log_format_is_used_even_for_a_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--log-format", "json", "--model", "/nonexistent/gpt2"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert '"level":"ERROR"' in line and '"proc":"worker"' in line and '"event":"start_failed"' in line
