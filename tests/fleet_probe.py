"""What the fleet tests and benchmark measure, from outside the replicas, every 10 ms:

- `UpstreamWatch`: the requests the fleet's shared echo worker is running, from the statistics
  it pushes to every link (started with `--stats-interval-s 0.01`). One process counts them, so
  each sample is the whole fleet's concurrency at one instant, as the upstream the cap protects
  sees it — unlike a sum of the replicas' own counts, read one after another.
- `GrantWatch`: what Redis keeps reserved, summed over every replica's entry in the fleet's hash
  (live or lapsed), per resource: the grants, which must never sum over the cap.

Both run in a thread, from `start()` to `stop()`, and keep every sample (time, value). And the
load they measure: `FleetLoad`, closed-loop clients spread over the replicas.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from typing import Any

import orjson
import redis

from governor.client import AsyncClient, Yielded
from governor.client.retry import NO_RETRY
from governor.fleet.lease import RESOURCES
from governor.fleet.member import KEY_SUFFIX
from govwire.errors import GovernorError

SAMPLE_S = 0.01


class UpstreamWatch:
    """A link to the echo worker at `address` (HOST:PORT) reading its `~stats` pushes."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._sock = socket.create_connection((host, int(port)), timeout=5)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> UpstreamWatch:
        self._thread.start()
        return self

    def _read(self) -> None:
        buffer = b""
        self._sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            now = time.monotonic()
            for line in lines:
                if line:
                    frame = orjson.loads(line)
                    if frame.get("status") == "stats":
                        self.samples.append((now, int(frame["running"])))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def peak(self, since: float = 0.0) -> int:
        return max((n for t, n in self.samples if t >= since), default=0)

    def mean(self, since: float, until: float = float("inf")) -> float:
        window = [n for t, n in self.samples if since <= t < until]
        return sum(window) / len(window) if window else 0.0


CLOCK = (b"~clock", "~clock")  # the fleet's clock, beside the replicas' entries


def reserved(entries: dict[Any, Any], resource: int = 0) -> float:
    """What a fleet hash's entries keep reserved of `resource` (RESOURCES order): each entry is
    "EXPIRY HOLD RELEASE SEQ" then per resource "LIMIT WANT HELD USAGE" (governor/fleet/lease.lua)."""
    return sum(float(value.split()[4 + 4 * resource + 2]) for field, value in entries.items() if field not in CLOCK)


class GrantWatch:
    """Samples the fleet `name`'s hash in the Redis on each of `ports` every 10 ms (a primary and
    its replicas: each sample is the most any of those that answer holds reserved, so a grant
    counts whichever node a failover promotes)."""

    def __init__(self, *ports: int, name: str = "governor") -> None:
        self._clients = [redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.2) for port in ports]
        self.key = f"{name}:{KEY_SUFFIX}"
        self.samples: list[tuple[float, tuple[float, ...], int]] = []  # (time, reserved per resource, replicas)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> GrantWatch:
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            views = []
            for client in self._clients:
                try:
                    views.append(client.hgetall(self.key))
                except redis.RedisError:  # that node down for a while
                    continue
            if views:
                per_resource = tuple(max(reserved(v, r) for v in views) for r in range(len(RESOURCES)))
                replicas = max(sum(1 for field in v if field not in CLOCK) for v in views)
                self.samples.append((time.monotonic(), per_resource, replicas))
            time.sleep(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for client in self._clients:
            client.close()

    def peak(self, resource: int = 0) -> float:
        return max((s[1][resource] for s in self.samples), default=0.0)


class FleetLoad:
    """Closed-loop clients in one background thread: `clients[port]` of them on the replica at that
    port, each sending a generate of `max_new_tokens`, and after a yield waiting for its hint.
    Counts what each replica did (`done[port]`, `yielded[reason]`, `failed[code]`); a lost
    connection is retried after 50 ms (a replica restarting), counted in `failed["connection"]`."""

    def __init__(self, clients: dict[int, int], max_new_tokens: int) -> None:
        self.clients, self.max_new_tokens = clients, max_new_tokens
        self.done: Counter[int] = Counter()
        self.done_at: list[tuple[float, int]] = []  # (time, port) of each completion
        self.yielded: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> FleetLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The clients stop once their request in flight ends."""
        self._stop.set()
        self._thread.join(30)

    def __enter__(self) -> FleetLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _main(self) -> None:
        await asyncio.gather(*(self._client(port) for port, n in self.clients.items() for _ in range(n)))

    async def _client(self, port: int) -> None:
        while not self._stop.is_set():
            try:
                async with AsyncClient(port=port, retry=NO_RETRY, timeout=30) as client:
                    while not self._stop.is_set():
                        try:
                            await client.generate("fleet", max_new_tokens=self.max_new_tokens)
                            self.done[port] += 1
                            self.done_at.append((time.monotonic(), port))
                        except Yielded as exc:
                            self.yielded[exc.reason] += 1
                            await asyncio.sleep(exc.retry_hint_ms / 1000)
                        except GovernorError as exc:
                            self.failed[exc.code] += 1
            except (OSError, ConnectionError, TimeoutError):
                self.failed["connection"] += 1
                await asyncio.sleep(0.05)
