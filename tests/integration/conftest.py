"""Real processes on loopback: a governor (which spawns its real worker) and raw TCP clients."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.fixtures.redis_server import RedisServer, free_port, free_ports
from govwire.codec import encode, generate_frame
from govwire.framing import LineSplitter
from govwire.vocab import FINAL_STATUSES
from tests.polling import wait_until

pytestmark = pytest.mark.integration
START_TIMEOUT_S = 20.0


class Conn:
    """A pipelining NDJSON client over one real TCP connection."""

    def __init__(self, port: int, timeout: float = 10.0, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._splitter = LineSplitter(1 << 24)
        self._ready: list[dict[str, Any]] = []
        if token is not None:
            self.sock.sendall(encode({"id": "auth", "op": "auth", "token": token}))
            assert self.recv() == {"id": "auth", "status": "authenticated"}

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, rid: str, prompt: str = "hello", **fields: Any) -> None:
        self.sock.sendall(encode(generate_frame(rid, prompt, **fields)))

    def recv(self) -> dict[str, Any]:
        while not self._ready:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by server")
            self._ready.extend(orjson.loads(line) for line in self._splitter.feed(data))  # type: ignore[arg-type]
        return self._ready.pop(0)

    def until_final(self, rid: str) -> list[dict[str, Any]]:
        """All replies for `rid` up to its final one (replies for other ids are kept aside)."""
        out: list[dict[str, Any]] = []
        aside: list[dict[str, Any]] = []
        while True:
            reply = self.recv()
            if reply.get("id") != rid:
                aside.append(reply)
                continue
            out.append(reply)
            if reply["status"] in FINAL_STATUSES or reply["status"] in ("pong", "stats"):
                self._ready[:0] = aside
                return out

    def finals(self, count: int) -> dict[str, dict[str, Any]]:
        """Read until `count` final replies arrived; returns id -> final reply."""
        done: dict[str, dict[str, Any]] = {}
        while len(done) < count:
            reply = self.recv()
            if reply["status"] in FINAL_STATUSES:
                done[reply["id"]] = reply
        return done

    def close(self) -> None:
        self.sock.close()


class Governor:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, metrics_port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.metrics_port = metrics_port
        self.log = log
        self.token: str | None = None  # set when it was started with --auth-token-file
        self._conns: list[Conn] = []

    def conn(self) -> Conn:
        conn = Conn(self.port, token=self.token)
        self._conns.append(conn)
        return conn

    def stats(self) -> dict[str, Any]:
        c = Conn(self.port, token=self.token)
        try:
            c.send_raw(b'{"id":"stats","op":"stats"}\n')
            return c.until_final("stats")[-1]
        finally:
            c.close()

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        _, text = self.http("/metrics")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        wait_until(predicate, timeout, what, self.log)

    def stop(self, timeout: float = 15.0) -> int:
        for conn in self._conns:
            conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture
def start_governor(tmp_path: Path) -> Iterator[Callable[..., Governor]]:
    started: list[Governor] = []

    names = itertools.count()

    def start(
        *flags: str, worker_args: tuple[str, ...] = (), wait_ready: bool = True, env: dict[str, str] | None = None
    ) -> Governor:
        """A governor; unless flags name an external --worker (or a --config file, which names its
        endpoints), it spawns one running `worker_args` (the echo engine unless they choose another).
        `env` is added to its environment. Safe to call from several threads at once. A port taken
        between `free_ports` and the governor's bind (another process's outgoing connection may get
        it) is retried with new ports, twice."""
        for attempt in range(3):
            port, metrics_port = free_ports(2)
            log = tmp_path / f"governor-{next(names)}.log"
            argv = [
                sys.executable, "-m", "governor", "serve", "--port", str(port), "--metrics-port", str(metrics_port)
            ]  # fmt: skip
            if "--worker" in flags or "--config" in flags:
                argv += flags
            else:
                engine = () if "--engine" in worker_args else ("--engine", "echo")
                argv += [*flags, "--", *engine, *worker_args]
            environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
            with log.open("wb") as out:  # the child keeps its own descriptor
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environment)
            governor = Governor(proc, port, metrics_port, log)
            started.append(governor)

            def ready(proc: subprocess.Popen[bytes] = proc, log: Path = log, governor: Governor = governor) -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"governor exited early:\n{log.read_text()}")
                try:
                    return governor.http("/readyz")[0] == (200 if wait_ready else 503)
                except OSError:
                    return False

            try:
                governor.wait_until(ready, START_TIMEOUT_S, "governor readiness")
            except AssertionError:
                if attempt < 2 and proc.poll() is not None and "is already in use" in log.read_text():
                    continue
                raise
            return governor
        raise AssertionError("unreachable")

    yield start
    for governor in started:
        try:
            governor.stop()
        except subprocess.TimeoutExpired:
            pass


class Worker(NamedTuple):
    address: str  # 127.0.0.1:PORT
    proc: subprocess.Popen[bytes]


@pytest.fixture
def start_worker() -> Iterator[Callable[..., Worker]]:
    """Standalone workers on free loopback ports, as `--worker` or `--direct` would reach them."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*worker_args: str, timeout: float = 60.0) -> Worker:
        port = free_port()
        argv = [sys.executable, "-m", "worker", "serve", "--listen", f"127.0.0.1:{port}", *worker_args]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(proc)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return Worker(f"127.0.0.1:{port}", proc)
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "worker did not start"
                time.sleep(0.1)

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server (or valkey-server) on a free loopback port, stopped after the test."""
    with RedisServer() as server:
        yield server
