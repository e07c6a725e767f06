"""This replica's membership of a fleet: the lease renewals, the only I/O of the fleet caps.

A task renews the lease (lease.FleetLease) by running lease.lua in Redis through
redis-py's asyncio client, one renewal at a time:

- every `renew_s`;
- at once after a reply that shrank a share, to confirm it (Redis frees the difference only
  once this replica reports that it applies the smaller share); a confirmation is not confirmed
  again, so shares that keep moving cost at most two renewals a period;
- early, at most every `renew_s / 4`, while the fleet limits are refusing frames here and the
  last reply said a renewal could bring more (the replica is under its target while others give
  back, or the fleet wants less than a limit), so a replica whose load grows takes free capacity
  without waiting a whole period, and a fleet whose shares have settled under contention renews
  once a period; and while this replica could give back capacity a contended fleet waits for
  (its requests above a share that shrank have ended, or most of its share lies idle), so a share
  moves to where the load went within a period or two.

Admission never waits for Redis: a slow or unreachable Redis only delays the next share, and the
lease lapses on its own (FleetLease.check) when no renewal succeeded for `lease_s`. A failed
renewal is retried every `renew_s`; the first success rejoins. Each success also moves the *cut*:
a timer at `FleetLease.cut_at`, when, were no other renewal to succeed, Redis would hand what this
replica holds to the others; if it fires, every request still running here is cancelled
(`on_cut`), so the fleet's cap holds through a partition however long. On shutdown the replica
deletes its entry so its share returns to the others at once instead of at its expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from governor.fleet.lease import EARLY_FRACTION, LEASE_SCRIPT, FleetLease, FleetState, LeaseReply
from governor.fleet.redis_url import FleetRedis
from governor.latency import Histogram

log = logging.getLogger("governor.fleet")

RENEWAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ERROR_LOG_INTERVAL_S = 10.0  # a Redis that stays unreachable is logged this often, not per renewal
KEY_SUFFIX = "leases:v2"
"""The fleet's hash is NAME:leases:v2: its entries carry the reservations' ends since v2, which
replicas of earlier versions (NAME:leases) would misread; the two never share a key."""


def default_member_id() -> str:
    """hostname:pid:random, unique over restarts (a new process never inherits an old entry)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def connect(where: FleetRedis, timeout_s: float) -> redis.Redis:
    """A client of the fleet's Redis: errors surface at once (the lease, not the client, decides
    how long to keep trying): no retries, and no read or connection waits longer than
    `timeout_s`. With Sentinel, every new connection asks the sentinels for the primary, so the
    renewals follow a failover."""
    timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if not where.sentinels:
        return redis.from_url(where.url, retry=Retry(NoBackoff(), 0), **timeouts)
    asking = {**timeouts, "password": where.sentinel_password, "retry": Retry(NoBackoff(), 0)}
    sentinel = Sentinel(list(where.sentinels), sentinel_kwargs=asking, **timeouts)
    primary: redis.Redis = sentinel.master_for(
        where.service,
        db=where.db,
        username=where.username,
        password=where.password,
        retry=Retry(NoBackoff(), 0),
        **timeouts,
    )
    return primary


class FleetMember:
    """Renews `lease` in the Redis at `url` under the key prefix `name`. With `acks` > 0 each
    renewal also waits (WAIT, at most half a period) for that many Redis replicas to have it, and
    a share it grew is applied only once they have: a failover then cannot lose a grant in use."""

    def __init__(
        self,
        url: str,
        name: str,
        lease: FleetLease,
        member_id: str = "",
        clock: Callable[[], float] = time.monotonic,
        on_cut: Callable[[], int] = lambda: 0,
        on_grown: Callable[[], None] = lambda: None,
        acks: int = 0,
    ) -> None:
        where = FleetRedis.parse(url)
        self.url = where.redacted()
        self.key = f"{name}:{KEY_SUFFIX}"
        self.member_id = member_id or default_member_id()
        self.lease = lease
        self._clock = clock
        # No wait longer than a period: a renewal lost in a partition gives way to the next
        # within a period, so a replica rejoins within about a period of the path healing; the
        # renewal it gave up on changes nothing should it still reach Redis (the script ignores
        # older renewals).
        self._redis = connect(where, lease.policy.renew_s)
        self._script = self._redis.register_script(LEASE_SCRIPT)
        self.acks = acks
        self.unacked = 0  # renewals whose growth was not applied: too few replicas had it in time
        self.up = False  # the last renewal came back in time: a lease is in force
        self.renewals = {"ok": 0, "error": 0}
        self.cuts = 0  # times the lease's reservation ran out here with requests cancelled
        self._on_cut = on_cut
        self._on_grown = on_grown  # the in-flight share grew: a client held for its slot may go in
        self._cut_timer: asyncio.TimerHandle | None = None
        self._seq = 0  # renewals sent: the script ignores one that reaches it after a later one
        self.renewal_seconds = Histogram(RENEWAL_BUCKETS)
        self._task: asyncio.Task[None] | None = None
        self._last_error_log = -float("inf")

    async def renew(self) -> bool:
        """One renewal: report, run the script, apply its reply. True when a share shrank."""
        lease = self.lease
        sent = self._clock()
        lease.next_renewal = sent + lease.policy.renew_s
        self._seq += 1
        args = lease.renewal_args(self.member_id, self._seq, sent)
        try:  # however many round trips a renewal takes (Sentinel, reconnecting), never past the lease
            raw, acked = await asyncio.wait_for(self._run_script(args), lease.policy.lease_s)
            reply = LeaseReply.parse(raw)
        except (RedisError, OSError, ValueError) as exc:  # TimeoutError is an OSError
            self._failed(exc)
            return False
        now = self._clock()
        self.renewal_seconds.observe(now - sent)
        was = lease.state
        durable = acked >= self.acks
        if not durable:
            self.unacked += 1
        shrank = lease.apply(reply, sent, now, durable=durable)
        if lease.state is not FleetState.LEASED:
            if durable:  # the reply came after the lease it renewed ran out
                self._failed(TimeoutError(f"the reply came {now - sent:.3f} s after the renewal, past the lease"))
            else:
                self._failed(RuntimeError(f"{acked} of the {self.acks} Redis replicas asked for had the renewal"))
            return False
        if durable:
            self.renewals["ok"] += 1
            self._schedule_cut(now)
        if not self.up or was is not FleetState.LEASED:
            log.info("event=fleet_joined key=%s member=%s replicas=%d", self.key, self.member_id, reply.replicas)
        self.up = True
        return shrank

    async def _run_script(self, args: list[str | float]) -> tuple[Any, int]:
        """The script's reply, and with `acks` how many Redis replicas had it in time (WAIT, at
        most half a period, on the same connection: a pipeline)."""
        if not self.acks:
            return await self._script(keys=[self.key], args=args), 0
        pipe = self._redis.pipeline(transaction=False)
        await self._script(keys=[self.key], args=args, client=pipe)
        pipe.execute_command("WAIT", self.acks, max(1, round(self.lease.policy.renew_s * 500)))
        raw, acked = await pipe.execute()
        return raw, int(acked)

    def _schedule_cut(self, now: float) -> None:
        """The cut, moved to the end of what the renewal just granted reserves."""
        if self._cut_timer is not None:
            self._cut_timer.cancel()
            self._cut_timer = None
        if self.lease.cut_at is not None:
            self._cut_timer = asyncio.get_running_loop().call_later(self.lease.cut_at - now, self._cut)

    def _cut(self) -> None:
        """No renewal succeeded until Redis gives up what this replica holds: admit nothing more
        and cancel what still runs."""
        self._cut_timer = None
        now = self._clock()
        lease = self.lease
        if lease.cut_at is None:
            return
        if now < lease.cut_at:  # the loop's timers may run a little early by this clock (uvloop: ms)
            self._cut_timer = asyncio.get_running_loop().call_later(lease.cut_at - now + 0.001, self._cut)
            return
        lease.lapse(now)
        cancelled = self._on_cut()
        self.cuts += 1
        log.warning(
            "event=fleet_lease_cut key=%s member=%s cancelled=%d lapsed_s=%.3f",
            self.key,
            self.member_id,
            cancelled,
            now - lease.valid_until,
        )

    def _failed(self, exc: Exception) -> None:
        self.renewals["error"] += 1
        now = self._clock()
        self.lease.lapse(now)
        if self.up or now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning(
                "event=fleet_renewal_failed url=%s error=%r lease_left_s=%.3f then=%s",
                self.url,
                str(exc) or type(exc).__name__,
                max(0.0, self.lease.valid_until - now),
                self.lease.policy.unavailable,
            )
        self.up = False

    def renewal_age_ms(self) -> float | None:
        """How long ago the renewal that granted the lease in force (or the last one) was sent;
        None before any succeeded."""
        renewed = self.lease.renewed_at
        return None if renewed == -float("inf") else round((self._clock() - renewed) * 1000, 1)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-lease")

    async def _run(self) -> None:
        lease = self.lease
        renew_s = lease.policy.renew_s
        early_s = renew_s / EARLY_FRACTION
        nudged = asyncio.Event()
        lease.nudge = nudged.set
        confirm = False
        while True:
            if confirm:
                confirm = False
                await self.renew()
                continue
            # Sleep until the period ends, and renew early (an early period after the last
            # renewal) while the fleet caps refuse frames here and a renewal could bring more, or
            # while this replica has capacity to give back to a fleet that waits for it: checked
            # every early period, and at once when the lease nudges (its in-flight share's first
            # refusal of a period: it has promised the slots that renewal brings, FleetLease.growth).
            while True:
                now = self._clock()
                due = lease.next_renewal
                if (lease.refusing and lease.could_grow) or lease.giving_back(now):
                    due = min(due, lease.next_renewal - renew_s + early_s)
                if now >= due:
                    break
                nudged.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(nudged.wait(), min(due - now, early_s))
            before = lease.inflight.share
            confirm = await self.renew()
            if lease.inflight.share > before:
                self._on_grown()

    async def join(self, timeout_s: float) -> bool:
        """The first renewal, before the listener opens, so the first frames find a lease."""
        try:
            await asyncio.wait_for(self.renew(), timeout_s)
        except TimeoutError:
            self._failed(TimeoutError(f"no reply within {timeout_s:.1f} s"))
        return self.up

    async def close(self) -> None:
        """Leave the fleet: stop renewing and give the share back at once."""
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await asyncio.wait_for(self._redis.hdel(self.key, self.member_id), self.lease.policy.renew_s)
        except (RedisError, OSError, TimeoutError):
            pass  # its entry expires with its lease
        await self._redis.aclose()
