"""The fleet through faults and at scale, over real processes: governor replicas sharing one echo
worker (the upstream the cap protects, whose own count of running requests is the fleet's
concurrency at one instant: benchmarks/harness/fixtures/fleet_probe.py) and one real redis-server,
with a fault proxy (benchmarks/harness/fixtures/fault_proxy.py) between one replica and Redis. The
long runs are benchmarks/admission/fleet.py's."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from benchmarks.harness.fixtures.fault_proxy import FaultProxy
from benchmarks.harness.fixtures.fleet_probe import FleetLoad, GrantWatch, UpstreamWatch
from benchmarks.harness.fixtures.redis_server import RedisServer, SentinelServer, free_port
from tests.integration.conftest import Governor, Worker
from tests.integration.test_fleet import share_of

pytestmark = pytest.mark.integration

RENEW_S, LEASE_S = 0.25, 1.0
SLACK_S = 0.3
"""How much later than it happened these tests may see a change: their polls (20 ms sleeps, stats
round trips) over a 2-core machine running the replicas, the worker, Redis and the load."""


def shared_worker(start_worker: Callable[..., Worker]) -> Worker:
    """The echo worker every replica relays to: 5 tokens 20 ms apart (about 85 ms a request),
    pushing its statistics every 10 ms for the UpstreamWatch."""
    return start_worker("--engine", "echo", "--token-delay-ms", "20", "--stats-interval-s", "0.01")


def start_replicas(
    start_governor: Callable[..., Governor], worker: Worker, urls: list[str], *flags: str, others: int = 0
) -> list[Governor]:
    """A replica per Redis URL, started side by side, each relaying to `worker`, and returned once
    each has seen all of them (and the `others` already running) join."""
    fleet = ("--fleet-renew-ms", str(RENEW_S * 1000), "--fleet-lease-ms", str(LEASE_S * 1000), *flags)

    def start(url: str) -> Governor:
        return start_governor("--worker", worker.address, "--max-inflight", "64", "--fleet", url, *fleet)

    with ThreadPoolExecutor(8) as pool:
        governors = list(pool.map(start, urls))
    size = len(urls) + others
    for governor in governors:  # joined, and past a new fleet's first lease (no share grows in it)
        governor.wait_until(lambda g=governor: g.stats()["fleet"]["replicas"] == size, 10, "all replicas joined")
        governor.wait_until(lambda g=governor: share_of(g) >= 1, 10, "a share")
    return governors


@pytest.mark.parametrize(("unavailable", "hold_s"), [("hold", 1.0), ("closed", 0.0)], ids=["hold", "closed"])
def test_a_partitioned_replica_never_takes_the_fleet_over_its_cap_and_rejoins_without_a_burst(
    redis_server: RedisServer,
    start_governor: Callable[..., Governor],
    start_worker: Callable[..., Worker],
    unavailable: str,
    hold_s: float,
) -> None:
    """Four loaded replicas share a cap of 8; one's path to Redis is black-holed for 3 s (its
    connections open, nothing answered) while it goes on serving its clients. Sampled every 10 ms,
    neither the upstream's running requests nor Redis's grants ever pass 8. Its reservation is
    handed to the others once nothing it held can be in use — lease and a half, hold, longest
    request (0.25 s) — within a renewal period; they then use the cap. Healed, it rejoins within two
    periods and has a share again within four, still never over the cap. Under `hold` it admitted
    during the hold; under `closed` it yielded `fleet_unavailable`."""
    cap, max_request_s = 8, 0.25
    worker = shared_worker(start_worker)
    with FaultProxy(redis_server.port) as proxy:
        urls = [proxy.url] + [redis_server.url] * 3
        tail = ("--fleet-unavailable", unavailable, "--fleet-hold-s", str(hold_s))
        tail += ("--fleet-max-request-s", str(max_request_s), "--fleet-max-inflight", str(cap))
        governors = start_replicas(start_governor, worker, urls, *tail)
        cut_off, others = governors[0], governors[1:]
        upstream, grants = UpstreamWatch(worker.address).start(), GrantWatch(redis_server.port).start()
        with FleetLoad({g.port: 6 for g in governors}, max_new_tokens=5) as load:
            time.sleep(1.5)
            proxy.set("blackhole")
            cut = time.monotonic()
            cut_off.wait_until(lambda: cut_off.stats()["fleet"]["state"] != "leased", 3, "the lapse")
            lapsed = time.monotonic()
            done_before = load.done[cut_off.port]
            watcher = others[0]  # the others see its reservation stand
            watcher.wait_until(lambda: watcher.stats()["fleet"]["lapsed"] == 1, 2, "a lapsed replica, reserved")
            time.sleep(max(0.0, lapsed + 3.0 - time.monotonic()))
            served_while_cut = load.done[cut_off.port] - done_before
            proxy.set("pass")
            healed = time.monotonic()
            cut_off.wait_until(lambda: cut_off.stats()["fleet"]["state"] == "leased", 3, "the rejoin")
            leased_s = time.monotonic() - healed
            cut_off.wait_until(lambda: share_of(cut_off) >= 1, 3, "a share after the rejoin")
            share_s = time.monotonic() - healed
            time.sleep(1.0)
        upstream.stop()
        grants.stop()

    assert upstream.peak() <= cap, f"the upstream ran {upstream.peak()} at once, over the fleet cap of {cap}"
    assert grants.peak() <= cap, f"Redis granted {grants.peak()} at once, over the fleet cap of {cap}"
    assert lapsed - cut <= LEASE_S + SLACK_S
    # Its reservation, handed over: the first sample without its entry.
    reserved_s = LEASE_S * 1.5 + hold_s + max_request_s  # the lease, half a lease (lease.lua's step), ...
    gone = next(t for t, _, entries in grants.samples if t > cut and entries == 3)
    assert reserved_s - RENEW_S <= gone - cut <= reserved_s + RENEW_S + SLACK_S, gone - cut
    used = upstream.mean(gone + 2 * RENEW_S, healed)
    assert used >= 0.75 * cap, f"the other replicas used {used:.1f} of {cap} once its share was back"
    assert leased_s <= 2 * RENEW_S + SLACK_S, f"rejoined {leased_s * 1000:.0f} ms after the path healed"
    # A share once the others have given it back: each shrinks at its next renewal, frees what it
    # holds above the new share as those requests end (about 85 ms), and confirms.
    assert share_s <= 4 * RENEW_S + SLACK_S, f"a share {share_s * 1000:.0f} ms after the path healed"
    if unavailable == "hold":
        assert served_while_cut > 0  # the hold: within its last share, reserved for it
    else:
        assert load.yielded["fleet_unavailable"] > 0
    assert not (set(load.failed) - {"fleet_lease_lost"}), load.failed
    for governor in others:
        assert governor.stats()["fleet"]["state"] == "leased"
    assert "event=fleet_lease_cut" in cut_off.log.read_text()  # past its reservation: nothing left running
    assert cut_off.metrics()[("governor_fleet_cuts_total", ())] == 1


def test_sixteen_replicas_share_one_cap_under_skew_and_never_exceed_it(
    redis_server: RedisServer, start_governor: Callable[..., Governor], start_worker: Callable[..., Worker]
) -> None:
    """Sixteen replicas, a cap of 32, closed-loop clients on half of them, skewed (12, 8, 6, 4, 3,
    3, 2, 2: 40 for 32 slots). Every 10 ms for 6 s, neither the upstream's running requests nor
    Redis's grants pass 32; while demand exceeds the cap most of it is in use; Redis runs one
    script per replica per period or so."""
    cap = 32
    worker = shared_worker(start_worker)
    governors = start_replicas(start_governor, worker, [redis_server.url] * 16, "--fleet-max-inflight", str(cap))
    clients = dict(zip((g.port for g in governors[:8]), (12, 8, 6, 4, 3, 3, 2, 2), strict=True))
    scripts_before = redis_server.evalsha_calls()
    upstream, grants = UpstreamWatch(worker.address).start(), GrantWatch(redis_server.port).start()
    started = time.monotonic()
    with FleetLoad(clients, max_new_tokens=5) as load:
        time.sleep(6.0)
    ended = time.monotonic()
    upstream.stop()
    grants.stop()
    scripts = redis_server.evalsha_calls() - scripts_before
    assert upstream.peak() <= cap, f"the upstream ran {upstream.peak()} at once, over the fleet cap of {cap}"
    assert grants.peak() <= cap, f"Redis granted {grants.peak()} at once, over the fleet cap of {cap}"
    used = upstream.mean(started + 2.0, ended)
    assert used >= 0.7 * cap, f"{used:.1f} of {cap} in use while 40 clients wanted it"
    assert load.yielded["fleet_inflight"] > 0 and not load.failed, (load.yielded, load.failed)
    per_replica_s = scripts / 16 / (ended - started)
    assert per_replica_s <= 3 / RENEW_S, f"{per_replica_s:.1f} renewals a second per replica"


FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def libfaketime() -> Path:
    """libfaketime, which `make test` installs (Debian's faketime package)."""
    found = next((p for p in (FAKETIME, Path("/usr/lib/faketime/libfaketime.so.1")) if p.exists()), None)
    if found is None:
        raise RuntimeError("the clock test needs libfaketime: run `make test`, which installs Debian's faketime")
    return found


def test_a_replica_whose_wall_clock_steps_keeps_its_lease_and_grants_nothing_twice(
    redis_server: RedisServer,
    start_governor: Callable[..., Governor],
    start_worker: Callable[..., Worker],
    tmp_path: Path,
) -> None:
    """One of three loaded replicas runs under libfaketime: its wall clock steps an hour ahead,
    then an hour back, while its monotonic clock runs on (as when NTP or an operator steps a
    host's time). Its lease is reckoned on the monotonic clock and the shared expiry on Redis's,
    so it never lapses, keeps renewing, and the fleet never passes its cap."""
    cap = 8
    step = tmp_path / "faketime"
    step.write_text("+0\n")
    env = {
        "LD_PRELOAD": str(libfaketime()),
        "FAKETIME_TIMESTAMP_FILE": str(step),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    worker = shared_worker(start_worker)
    fleet = ("--fleet", redis_server.url, "--fleet-max-inflight", str(cap), "--max-inflight", "64")
    http_port = free_port()
    stepped = start_governor("--worker", worker.address, *fleet, "--http-port", str(http_port), env=env)
    urls = [redis_server.url] * 2
    governors = [stepped, *start_replicas(start_governor, worker, urls, "--fleet-max-inflight", str(cap), others=1)]
    stepped.wait_until(lambda: stepped.stats()["fleet"]["replicas"] == 3, 5, "all replicas joined")
    upstream, grants = UpstreamWatch(worker.address).start(), GrantWatch(redis_server.port).start()
    states: list[str] = []
    seen: list[float] = []  # its wall clock against ours, read from what it stamps (/v1/models `created`)
    with FleetLoad({g.port: 6 for g in governors}, max_new_tokens=5) as load:
        for offset in ("+0", "+3600", "-3600", "+0"):
            step.write_text(offset + "\n")
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=5) as reply:
                seen.append(orjson.loads(reply.read())["data"][0]["created"] - time.time())
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                states.append(stepped.stats()["fleet"]["state"])
                time.sleep(0.05)
    upstream.stop()
    grants.stop()
    assert [round(s / 60) * 60 for s in seen] == [0, 3600, -3600, 0], seen  # the steps took
    assert set(states) == {"leased"}, states
    assert upstream.peak() <= cap and grants.peak() <= cap, (upstream.peak(), grants.peak())
    assert load.done[stepped.port] > 0 and not load.failed, load.failed
    renewals = stepped.stats()["fleet"]["renewals"]
    assert renewals["error"] == 0 and renewals["ok"] >= 6 / RENEW_S * 0.8, renewals


def test_a_sentinel_failover_under_load_keeps_every_replica_admitting_within_the_cap(
    start_governor: Callable[..., Governor], start_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    """Redis with two replicas and a Sentinel; three loaded governor replicas reach it through
    `redis+sentinel://` and apply a grown share only once a Redis replica has it
    (`--fleet-replica-acks 1`). The primary is SIGKILLed: Sentinel promotes a replica, the
    governors follow it and renew there, and through it all every governor goes on admitting
    (the hold covers the failover) while the upstream and every Redis node's grants stay within
    the cap."""
    cap = 8
    primary = RedisServer().start()
    replicas = [RedisServer(replica_of=primary.port).start() for _ in range(2)]
    nodes = [primary, *replicas]
    try:
        deadline = time.monotonic() + 10
        while any(n.client().info("replication").get("master_link_status") != "up" for n in replicas):
            assert time.monotonic() < deadline, "the Redis replicas did not sync"
            time.sleep(0.05)
        sentinel = SentinelServer(primary.port, tmp_path).start()
        worker = shared_worker(start_worker)
        flags = ("--fleet-max-inflight", str(cap), "--fleet-replica-acks", "1")
        governors = start_replicas(start_governor, worker, [sentinel.url] * 3, *flags)
        upstream = UpstreamWatch(worker.address).start()
        grants = GrantWatch(*(node.port for node in nodes)).start()
        states: list[str] = []
        with FleetLoad({g.port: 6 for g in governors}, max_new_tokens=5) as load:
            time.sleep(1.5)
            primary.stop()
            killed = time.monotonic()
            deadline = killed + 15
            while time.monotonic() < deadline:
                states += [g.stats()["fleet"]["state"] for g in governors]
                if sentinel.primary() != primary.port and all(
                    g.stats()["fleet"]["state"] == "leased" for g in governors
                ):
                    break
                time.sleep(0.05)
            recovered = time.monotonic()
            time.sleep(1.0)
        upstream.stop()
        grants.stop()
        sentinel.stop()
    finally:
        for node in nodes:
            node.stop()
    assert recovered - killed < 15, "the governors did not all renew on the promoted primary"
    assert "closed" not in states, "a governor stopped admitting during the failover"
    assert upstream.peak() <= cap, f"the upstream ran {upstream.peak()} at once, over the fleet cap of {cap}"
    assert grants.peak() <= cap, f"a Redis node held {grants.peak()} granted, over the fleet cap of {cap}"
    for governor in governors:  # admitting throughout: completions in every half second
        times = [t for t, port in load.done_at if port == governor.port and killed - 0.5 <= t <= recovered]
        gaps = [b - a for a, b in zip([killed - 0.5, *times], [*times, recovered], strict=True)]
        assert max(gaps) < 0.5, f"replica on {governor.port} admitted nothing for {max(gaps):.2f} s"
    assert not load.failed, load.failed
