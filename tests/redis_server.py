"""A real redis-server (or valkey-server) on a loopback port, without persistence, for the fleet
tests and benchmarks (tests/fault_proxy.py puts faults between it and a replica)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

SERVER_BINARIES = ("redis-server", "valkey-server")


def server_binary() -> str:
    """The server on the PATH; `make test` installs one where it is missing."""
    for name in SERVER_BINARIES:
        path = shutil.which(name)
        if path is not None:
            return path
    raise RuntimeError(
        "the fleet tests need redis-server or valkey-server on the PATH: run `make test`, which installs it"
    )


def free_port() -> int:
    """A loopback port nobody listens on now (the integration tests' too)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports: held open together while chosen, since the kernel
    may hand a port just released straight back to the next bind(0)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class RedisServer:
    """`start()` runs the server on `port` (a free one by default); `stop()` kills it; starting
    it again serves the same port, empty (no persistence), as a restarted Redis would. With
    `replica_of`, it replicates the server on that port."""

    def __init__(self, port: int = 0, replica_of: int | None = None) -> None:
        self.port = port or free_port()
        self.replica_of = replica_of
        self.proc: subprocess.Popen[bytes] | None = None
        self.directory: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        # Its own directory: a primary writes an RDB file for a replica's full sync even with
        # --save "", and it must not land in the working directory.
        self.directory = tempfile.TemporaryDirectory(prefix="redis-")
        argv = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", self.directory.name]
        if self.replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[0]} did not start on port {self.port}") from None
                time.sleep(0.02)

    def client(self) -> redis.Redis:
        """A redis-py client of the server, for what the tests and benchmarks read from it."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def evalsha_calls(self) -> int:
        """How many scripts the server ran by SHA (the lease renewals) since it started."""
        with self.client() as client:
            stats = client.info("commandstats").get("cmdstat_evalsha", {})
        return int(stats.get("calls", 0))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.directory is not None:
            self.directory.cleanup()
            self.directory = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SentinelServer:
    """One Redis Sentinel (the server binary in sentinel mode, as Debian's redis-sentinel runs it)
    watching the primary on `primary_port` as `service`, quorum 1, declaring it down after
    `down_after_ms`. Its config file, which Sentinel rewrites, lives in `directory`."""

    def __init__(self, primary_port: int, directory: Path, service: str = "fleet", down_after_ms: int = 500) -> None:
        self.port = free_port()
        self.service = service
        self.config = directory / f"sentinel-{self.port}.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\n"
            f"sentinel monitor {service} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} 5000\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}"

    def start(self, timeout: float = 10.0) -> SentinelServer:
        self.proc = subprocess.Popen(
            [server_binary(), str(self.config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.primary() is not None:
                    return self
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sentinel did not start on port {self.port}")
            time.sleep(0.02)

    def primary(self) -> int | None:
        """The port of the primary it names now."""
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2) as client:
            address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(address[1]) if address else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
