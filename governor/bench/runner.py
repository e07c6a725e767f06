"""Drives a governor (or, with --direct, a worker) with a workload and records what each request saw.

Open loop (`--concurrency 0`): requests are submitted on the chosen schedule whatever happens to
the earlier ones, spread round-robin over `--connections` pipelined connections. Closed loop
(`--concurrency N`): N clients, each sending its next request when its previous one ended.
With `--tenant-mix` each request's frames carry its group's tenant and class; a tenant with a
`--tenant-token` has `--connections` connections of its own, opened with that secret.
With `--retry` a yielded request is sent again after its `retry_hint_ms` (exactly, with its
`retry_ticket`, when the yield booked an appointment; else times a jitter factor in [1, 1.2)), up
to `--max-retries` times; its TTFT and latency then count from its first
submission, as its user would see them.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from governor.bench.config import BenchConfig, parse_length_dist
from governor.bench.schedule import ScheduleKind, SubmitSchedule
from governor.bench.stats import RequestSample
from governor.bench.tenants import TenantGroup
from governor.client import NO_RETRY, AsyncClient, ConnectionLost, GovernorError, Result, Token, Yielded
from governor.client.aio import Reply
from governor.client.session import Accepted
from govwire.vocab import FinishReason


@dataclass
class RunResult:
    samples: list[RequestSample]
    wall_s: float
    submit_lags_s: list[float]  # absolute and poisson schedules only
    submit_wall_s: float  # first to last first-attempt submission
    submitted: int  # requests whose first attempt was sent (all of them, unless the run timed out)
    # (seconds since t0, inflight, yielded_total) from the governor's stats, polled during the run;
    # empty with --direct (a worker has no stats op)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def arrival_rate(self) -> float:
        """First submissions per second over the submit wall: the arrival rate the server saw."""
        return (self.submitted - 1) / self.submit_wall_s if self.submit_wall_s > 0 else 0.0


@dataclass
class _Request:
    index: int
    prompt: str
    group: TenantGroup
    client: AsyncClient  # the connection its attempts go over
    sample: RequestSample
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    ticket: str | None = None  # the appointment its last yield booked, sent back by its retry


def make_prompts(config: BenchConfig, rng: random.Random) -> list[str]:
    """The workload's prompts: --prompt repeated, or random text of --prompt-len-dist characters."""
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    lengths = parse_length_dist(config.prompt_len_dist) if config.prompt_len_dist else None
    prompts: list[str] = []
    for i in range(config.num_requests):
        if lengths is not None:
            low, high = lengths
            n = low if low == high else rng.randint(low, high)
            prompt = "".join(rng.choice(alphabet) for _ in range(n))
        else:
            prompt = config.prompt * config.prompt_repeats
        prompts.append(f"{i}: {prompt}" if config.unique_prompts else prompt)
    return prompts


class _StatsPoll:
    """The governor's inflight and yield count over a run, over a connection of its own."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def sample(self) -> tuple[int, int]:
        stats = await self.client.stats()
        return int(stats["inflight"]), int(stats["yielded_total"])

    async def run(self, t0: float, timeline: list[tuple[float, int, int]], interval_ms: float) -> None:
        while True:
            await asyncio.sleep(interval_ms / 1000)
            inflight, yielded = await self.sample()
            timeline.append((time.monotonic() - t0, inflight, yielded))


class BenchRun:
    def __init__(self, config: BenchConfig, prompts: list[str], groups: list[TenantGroup], rng: random.Random) -> None:
        self.config = config
        self.prompts = prompts
        self.groups = groups  # each request's --tenant-mix group
        self.rng = rng
        # The client asks for an `accepted` reply (ack) on every request: submit -> ack latency.
        self._fields: dict[str, Any] = {"max_new_tokens": config.max_new_tokens, "stop_on_eos": config.stop_on_eos}
        if config.deadline_ms:
            self._fields["deadline_ms"] = config.deadline_ms

    async def run(self) -> RunResult:
        address = self.config.direct or self.config.address
        token = self.config.token()
        poll = None if self.config.direct else _StatsPoll(AsyncClient(address=address, token=token, retry=NO_RETRY))
        requests, clients = self._requests(address, token)
        lags: list[float] = []
        timeline: list[tuple[float, int, int]] = []
        try:
            for client in clients:
                await client.connect()
            if poll is not None:
                timeline.append((0.0, *await poll.sample()))  # the baseline: a burst's yields show at once
            t0 = time.monotonic()
            poller = None if poll is None else asyncio.create_task(poll.run(t0, timeline, self.config.poll_interval_ms))
            try:
                await asyncio.wait_for(self._submit_all(requests, t0, lags), self.config.timeout_s)
            except TimeoutError:
                pass
            finally:
                if poller is not None:
                    poller.cancel()
        finally:
            for client in [*clients, *([] if poll is None else [poll.client])]:
                await client.aclose()
        for request in requests:
            if not request.sample.status:
                request.sample.status, request.sample.code = "error", "timeout"
        finals = [r.sample.t_final for r in requests if r.sample.t_final is not None]
        submits = [r.sample.t_submit for r in requests if r.sample.t_submit]
        return RunResult(
            samples=[r.sample for r in requests],
            wall_s=(max(finals) if finals else time.monotonic()) - t0,
            submit_lags_s=lags,
            submit_wall_s=(max(submits) - min(submits)) if submits else 0.0,
            submitted=len(submits),
            timeline=timeline,
        )

    def _requests(self, address: str, token: str | None) -> tuple[list[_Request], list[AsyncClient]]:
        """The workload's requests, each with its connection, and the connections. A tenant with a
        --tenant-token gets a set of its own, opened with its secret; the other requests share the
        set opened with `token`. Within a set, requests take the connections in turn."""
        tokens = self.config.tenant_tokens()
        turns: dict[str, Iterator[AsyncClient]] = {}
        clients: list[AsyncClient] = []
        requests: list[_Request] = []
        for i, (prompt, group) in enumerate(zip(self.prompts, self.groups, strict=True)):
            key = group.tenant if group.tenant in tokens else ""
            if key not in turns:
                # No timeouts or retries inside the client: the run has its own deadline and retry rule.
                own = [
                    AsyncClient(address=address, token=tokens.get(key, token), timeout=None, retry=NO_RETRY)
                    for _ in range(self.config.connections)
                ]
                clients += own
                turns[key] = itertools.cycle(own)
            sample = RequestSample(t_submit=0.0, group=group.label)
            requests.append(_Request(i, prompt, group, next(turns[key]), sample))
        return requests, clients

    async def _submit_all(self, requests: list[_Request], t0: float, lags: list[float]) -> None:
        config = self.config
        if config.concurrency:
            queue = list(reversed(requests))

            async def client() -> None:
                while queue:
                    request = queue.pop()
                    self._send(request)
                    await request.finished.wait()

            await asyncio.gather(*(client() for _ in range(config.concurrency)))
            return
        schedule = SubmitSchedule(ScheduleKind(config.submit_schedule), config.submit_interval_ms / 1000)
        targets = schedule.targets(len(requests), self.rng)
        for request in requests:
            if targets is not None:
                delay = t0 + targets[request.index] - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            self._send(request)
            if targets is not None:
                lags.append(request.sample.t_submit - t0 - targets[request.index])
            if targets is None and schedule.interval_s:
                await asyncio.sleep(schedule.interval_s)
        await asyncio.gather(*(r.finished.wait() for r in requests))

    def _send(self, request: _Request) -> None:
        sample = request.sample
        if sample.attempts == 0 and self.config.submit_work_ms:
            # Blocks the event loop like synchronous client work (tokenizing, building the request)
            # would, but sleeps rather than spins, so it takes no CPU from a server on the same machine.
            time.sleep(self.config.submit_work_ms / 1000)
        now = time.monotonic()
        if sample.attempts == 0:
            sample.t_submit = now
        sample.attempts += 1
        try:
            request.client.submit(
                request.prompt,
                functools.partial(self._on_event, request, now),
                tenant=request.group.tenant or None,
                priority=request.group.priority,
                retry_ticket=request.ticket,
                **self._fields,
            )
        except ConnectionLost:
            self._settle(request, "error", now, "connection_lost")

    def _on_event(self, request: _Request, sent: float, event: Reply, now: float) -> None:
        sample = request.sample
        if isinstance(event, Token):
            sample.token_times.append(now)
        elif isinstance(event, Accepted):
            sample.ack_latency = now - sent
        elif isinstance(event, Result):
            sample.prompt_tokens = event.prompt_tokens
            sample.completion_tokens = event.completion_tokens
            sample.server = {k: v for k, v in event.reply.items() if k.endswith("_ms")}
            if event.finish_reason == FinishReason.CANCELLED:  # cut off (a drain): not a completion
                self._settle(request, "error", now, "cancelled")
            else:
                self._settle(request, "done", now)
        elif isinstance(event, Yielded):
            sample.yield_latencies.append(now - sent)
            if self.config.retry and sample.attempts <= self.config.max_retries:
                request.ticket = event.retry_ticket
                jitter = 1.0 if event.retry_ticket is not None else self.rng.uniform(1.0, 1.2)
                hint_s = event.retry_hint_ms / 1000 * jitter
                asyncio.get_running_loop().call_later(hint_s, self._send, request)
            else:
                self._settle(request, "yield", now, event.reason)
        elif isinstance(event, GovernorError):
            self._settle(request, "error", now, event.code)
        elif isinstance(event, ConnectionLost):
            self._settle(request, "error", now, "connection_lost")

    @staticmethod
    def _settle(request: _Request, status: str, now: float, code: str | None = None) -> None:
        sample = request.sample
        sample.status, sample.t_final, sample.code = status, now, code
        request.finished.set()
