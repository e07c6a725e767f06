"""A loopback TCP proxy that injects network faults between a client and a server (one replica's
path to Redis, in the fleet tests and benchmarks), switched while connections are open:

- `pass`: bytes flow both ways;
- `delay`: what the server sends back is held `delay_s` per chunk (a slow Redis or network);
- `blackhole`: connections stay open and new ones are accepted, but nothing is forwarded either
  way (a partition as TCP sees it: no reset, no reply, only timeouts);
- `reset`: every open connection is reset (RST) and new ones are reset at once;
- `refuse`: open connections are closed and new ones closed at once (a server that went away).

Back to `pass`, new connections flow again (the bytes a blackhole swallowed are gone, as in a
real partition; connections that saw them are left to the client's timeouts).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Literal

Mode = Literal["pass", "delay", "blackhole", "reset", "refuse"]


class FaultProxy:
    """Forwards a free loopback port to `target_port`; `set(mode)` switches the fault."""

    def __init__(self, target_port: int, mode: Mode = "pass", delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.mode: Mode = mode
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def set(self, mode: Mode) -> None:
        """Switch the fault; `reset` and `refuse` end the open connections at once."""
        self.mode = mode
        if mode in ("reset", "refuse"):
            with self._lock:
                pairs, self._pairs = self._pairs, []
            for client, server in pairs:
                _end(client, reset=mode == "reset")
                _end(server, reset=mode == "reset")

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode in ("reset", "refuse"):
                _end(client, reset=self.mode == "reset")
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                _end(client, reset=True)
                continue
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, to_client: bool) -> None:
        try:
            while data := source.recv(65536):
                mode = self.mode
                if mode == "blackhole":
                    continue  # swallowed: the peer waits for an answer that never comes
                if mode == "delay" and to_client:
                    time.sleep(self.delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _end(source, reset=False)
            _end(sink, reset=False)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.set("refuse")

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end(sock: socket.socket, reset: bool) -> None:
    """Close `sock`; with `reset`, abortively (SO_LINGER 0: the peer gets an RST)."""
    with contextlib.suppress(OSError):
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
