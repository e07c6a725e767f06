"""Helpers shared by the benchmark scripts: start processes, wait for ports, read RSS and CPU time."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from subprocess import Popen
from typing import Any

import orjson

from benchmarks.harness.results import Machine
from governor.bench.config import BenchConfig
from governor.bench.main import measure
from governor.bench.runner import RunResult
from governor.bench.stats import Distribution, Summary
from governor.client import Client
from govwire.framing import TOO_LARGE, LineSplitter

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parent  # the load tools the benchmarks start as processes
UNLIMITED = 1_000_000  # --max-inflight for "no cap in practice"


async def ndjson_replies(reader: asyncio.StreamReader) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """Each reply on a governor's NDJSON connection as it comes, with the time its read returned,
    until the connection closes."""
    splitter = LineSplitter(1 << 20)
    while data := await reader.read(1 << 16):
        now = time.monotonic()
        for line in splitter.feed(data):
            if line is TOO_LARGE:
                raise ValueError("a reply over 1 MiB: not one the governor sends")
            yield now, orjson.loads(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


def stats(port: int) -> dict[str, Any]:
    """One `stats` frame over a fresh connection."""
    with Client("127.0.0.1", port, timeout=10) as client:
        return client.stats()


def start(argv: list[str], log: Path | None = None, cwd: Path = ROOT) -> Popen[bytes]:
    """`python ARGV` from `cwd`, whose packages come first on the path (a baseline tree's, see
    results.baseline_tree)."""
    out = log.open("wb") if log else subprocess.DEVNULL
    try:
        return Popen([sys.executable, *argv], cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


def start_gpt2_worker(name: str, model: str, threads: int, dtype: str) -> tuple[Popen[bytes], int]:
    """A standalone GPT-2 worker (`worker serve`) on a free port, pushing stats every 0.25 s;
    its log goes to benchmarks/out/NAME_worker.log."""
    port = free_port()
    flags = ["--engine", "gpt2", "--model", model, "--threads", str(threads), "--dtype", dtype]
    argv = ["-m", "worker", "serve", "--listen", f"127.0.0.1:{port}", *flags, "--stats-interval-s", "0.25"]
    proc = start(argv, out_dir() / f"{name}_worker.log")
    try:
        wait_for_port(port, timeout=300)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def start_governor(
    *flags: str, worker_args: tuple[str, ...] = (), log: Path | None = None, timeout: float = 20.0, cwd: Path = ROOT
) -> tuple[Popen[bytes], int]:
    """A governor on a free port (metrics off), once its worker is linked (`timeout` covers loading a
    model): the one `flags` name with --worker, or a spawned one (echo unless `worker_args` choose);
    `cwd`: the tree it runs from."""
    port = free_port()
    argv = ["-m", "governor", "serve", "--port", str(port), "--metrics-port", "0", "--log-level", "warning", *flags]
    if "--worker" not in flags:
        engine = () if "--engine" in worker_args else ("--engine", "echo")
        argv += ["--", *engine, *worker_args]
    proc = start(argv, log, cwd)
    try:
        wait_for_port(port)
        wait_until(lambda: stats(port)["workers"][0]["up"], timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def start_front_door(
    *flags: str, worker_args: tuple[str, ...] = (), log: Path | None = None, timeout: float = 20.0, cwd: Path = ROOT
) -> tuple[Popen[bytes], int, int]:
    """`start_governor` with its OpenAI-compatible front door on a free port too (`--integrity
    optional`: OpenAI clients send no digest), once that listens: (process, NDJSON port, HTTP port)."""
    http = free_port()
    flags = ("--http-port", str(http), "--integrity", "optional", *flags)
    proc, port = start_governor(*flags, worker_args=worker_args, log=log, timeout=timeout, cwd=cwd)
    try:
        wait_for_port(http)
    except BaseException:
        stop(proc)
        raise
    return proc, port, http


def stop(proc: Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat, in clock ticks: 10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine() -> str:
    """The machine in one line, for the top of a benchmark's output (results.Machine has the fields)."""
    return Machine.here().line()


def bench(address: str, **fields: Any) -> tuple[Summary, RunResult]:
    """One `governor bench` run (after its warm-up runs) in this process; prints its report."""
    *_, last = asyncio.run(measure(BenchConfig(address=address, **fields)))
    return last


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def median_ms(summaries: list[Summary], pick: Callable[[Summary], float | None]) -> str:
    """The median over repeated runs of one figure, formatted."""
    values = [v for s in summaries if (v := pick(s)) is not None]
    return ms(statistics.median(values)) if values else "-"


def server_p99(result: RunResult, key: str) -> float | None:
    """p99 of one of the server's own timings from `done` (queue_wait_ms, prefill_ms, ...)."""
    return Distribution.of([s.server[key] for s in result.samples if key in s.server]).p99


def random_text(rng: random.Random, n: int) -> str:
    """`n` characters of lowercase words: n tokens for the random model's bytes tokenizer."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n))


def fmt(x: float | None, digits: int = 0) -> str:
    """A number for a table, thousands separated; `-` for none."""
    return "-" if x is None else f"{x:,.{digits}f}"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def out_dir() -> Path:
    path = ROOT / "benchmarks" / "out"
    path.mkdir(exist_ok=True)
    return path
