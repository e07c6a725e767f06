"""A real redis-server (or valkey-server) on a loopback port, without persistence, for the fleet
tests and benchmarks; and a loopback TCP relay that delays what the server sends back."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time

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
    it again serves the same port, empty (no persistence), as a restarted Redis would."""

    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        argv = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
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

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DelayRelay:
    """Forwards a loopback port to the server, holding every chunk the server sends back for
    `delay_s` (a slow Redis, or a slow network, for the client)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.delay_s), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        try:
            while data := source.recv(65536):
                if delay_s:
                    time.sleep(delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> DelayRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
