"""Open-loop admission experiments: seeded arrivals sent through a governor in front of one worker.

The skeleton the admission experiments share (admission/token_admission.py, admission/tenants.py;
the template for the next one). One standalone GPT-2 worker (`worker serve`) serves every run of
an experiment; each configuration is a `governor serve --worker` in front of it, started in turn,
so configurations differ only in their governor flags. Arrivals are planned before any run
(Poisson, seeded), so configurations compared side by side see the same arrivals, and each is sent
at its planned time from one asyncio client. TTFT counts from a request's first submission,
retries included, as its user sees it; `admitted_s` is when the attempt that got in was sent, so
the wait the governor added (`added_wait_s`) is told apart from the engine's time to a first
token. A client retries a yield at its hint, as the SDKs do, only while its experiment says so
(`retry_until`, `retries`), and never a `final` one (the governor said nothing frees for it within
its promise horizon: an SDK's `x-should-retry: false`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from subprocess import Popen
from typing import Any

from benchmarks.harness.common import out_dir, random_text, start_governor, start_gpt2_worker, stats, stop
from benchmarks.harness.results import Sitting
from governor.bench.stats import percentile
from governor.client import NO_RETRY, AsyncClient, GovernorError, Yielded

MAX_NEW = 16  # new tokens per request: greedy, end-of-sequence ignored


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the run's start
    prompt: str
    kind: str = ""  # the experiment's label for its request shape ("short", "long")
    tenant: str = ""
    priority: str | None = None


@dataclass
class Outcome:
    arrival: Arrival
    status: str  # done | yield | error: the last attempt's
    code: str | None  # the last yield's reason or the error's code
    attempts: int
    ttft_s: float | None  # from the first submission
    sent_s: float  # the first submission, from the run's start
    reasons: tuple[str, ...] = ()  # of the yields it met, in order
    admitted_s: float | None = None  # the done attempt's submission, from the run's start
    ended_s: float | None = None  # its last reply, from the run's start
    final: bool = False  # the last yield was final (not to be retried)
    hints: tuple[tuple[float, int, bool], ...] = ()  # each yield: (when, from the run's start; hint ms; ticket)

    @property
    def added_wait_s(self) -> float | None:
        """From the first submission to the one that got in: what retrying cost it."""
        return None if self.admitted_s is None else self.admitted_s - self.sent_s

    def first_token_within(self, seconds: float) -> bool:
        """Whether it was done with a first token within `seconds` of its first submission."""
        return self.status == "done" and self.ttft_s is not None and self.ttft_s <= seconds


@dataclass
class Run:
    name: str
    outcomes: list[Outcome]
    wall_s: float
    timeline: list[dict[str, float]] = field(default_factory=list)  # polled stats, when asked for
    stats: dict[str, Any] = field(default_factory=dict)  # the governor's, at the end of the run

    def of(self, tenant: str | None = None, priority: str | None = None) -> list[Outcome]:
        return [
            o
            for o in self.outcomes
            if (tenant is None or o.arrival.tenant == tenant) and (priority is None or o.arrival.priority == priority)
        ]

    def done(self, kind: str | None = None) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "done" and (kind is None or o.arrival.kind == kind)]

    def ttft_ms(self, q: float, kind: str | None = None, since: float = 0.0, until: float = 1e9) -> float | None:
        return ttft_ms([o for o in self.done(kind) if since <= o.sent_s < until], q)

    def done_count(self, kind: str | None = None, since: float = 0.0, until: float = 1e9) -> int:
        """The sample count behind `ttft_ms` with the same arguments."""
        return sum(1 for o in self.done(kind) if since <= o.sent_s < until and o.ttft_s is not None)

    @property
    def rps(self) -> float:
        return len(self.done()) / self.wall_s

    def goodput(self, slo_s: float) -> float:
        return sum(1 for o in self.done() if o.ttft_s is not None and o.ttft_s <= slo_s) / self.wall_s

    def count(self, status: str, code: str | None = None) -> int:
        return sum(1 for o in self.outcomes if o.status == status and (code is None or o.code == code))


def hint_outcomes(snapshot: dict[str, Any]) -> str:
    """What became of the refused clients' appointments, per limit that booked them (`stats`
    `retry_hints.outcomes`: on time, early, lapsed, ...), and each book's trust: one line."""
    hints = snapshot.get("retry_hints") or {}
    outcomes = hints.get("outcomes") or {}
    trust = hints.get("trust") or {}
    parts = [
        f"{reason}: " + ", ".join(f"{outcome} {n}" for outcome, n in sorted(counts.items()) if n)
        + (f" (trust {trust[reason]:.2f})" if reason in trust else "")
        for reason, counts in sorted(outcomes.items())
    ]  # fmt: skip
    return "; ".join(parts) or "none"


def ttft_ms(outcomes: list[Outcome], q: float) -> float | None:
    """The q-quantile (0-1) of the completed outcomes' TTFT, ms, interpolated between ranks
    (governor.bench.stats.percentile); None for none. Report it with its sample count
    (`done_count`): a p99 of fewer than 100 requests is mostly their largest two."""
    value = percentile([o.ttft_s for o in outcomes if o.status == "done" and o.ttft_s is not None], 100 * q)
    return None if value is None else 1000 * value


def poisson(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second over `seconds`."""
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return times
        times.append(t)


async def send(
    client: AsyncClient,
    a: Arrival,
    t0: float,
    *,
    deadline_ms: float = 0.0,
    retry_until: float | None = None,
    victim_until: float | None = None,
) -> Outcome:
    """Send `a` at its time. A yield ends it unless `retry_until`: then it is retried after its
    hint until then. A `preempted` yield (admitted, then displaced before its first token) is
    retried until `victim_until` whatever `retry_until` says, as a client that saw its request
    accepted does (the OpenAI SDKs retry a 429). A `final` yield is never retried. A retry sends
    the yield's ticket back and comes at the hint exactly when there is one, else with up to 20%
    jitter added (protocol.md)."""
    await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
    sent = time.perf_counter()
    fields: dict[str, Any] = {"temperature": 0.0, "stop_on_eos": False}
    if deadline_ms:
        fields["deadline_ms"] = deadline_ms
    attempts = 0
    reasons: list[str] = []
    hints: list[tuple[float, int, bool]] = []
    ticket: str | None = None
    while True:
        attempts += 1
        first: float | None = None
        attempt = time.perf_counter()
        try:
            async with client.stream(
                a.prompt, max_new_tokens=MAX_NEW, tenant=a.tenant or None, priority=a.priority,
                retry_ticket=ticket, **fields,
            ) as stream:  # fmt: skip
                async for _ in stream:
                    first = first or time.perf_counter()
        except Yielded as exc:
            reasons.append(exc.reason)
            ticket = exc.retry_ticket
            hints.append((time.perf_counter() - t0, exc.retry_hint_ms, ticket is not None))
            wait = exc.retry_hint_ms / 1000 * (1.0 if ticket else random.uniform(1.0, 1.2))
            until = victim_until if "preempted" in reasons else retry_until
            if exc.final or until is None or time.perf_counter() + wait > until:
                ended = time.perf_counter() - t0
                return Outcome(
                    a,
                    "yield",
                    exc.reason,
                    attempts,
                    None,
                    sent - t0,
                    tuple(reasons),
                    ended_s=ended,
                    final=exc.final,
                    hints=tuple(hints),
                )
            await asyncio.sleep(wait)
            continue
        except GovernorError as exc:
            ended = time.perf_counter() - t0
            return Outcome(
                a, "error", exc.code, attempts, None, sent - t0, tuple(reasons), ended_s=ended, hints=tuple(hints)
            )
        ttft = None if first is None else first - sent
        ended = time.perf_counter() - t0
        return Outcome(
            a, "done", None, attempts, ttft, sent - t0, tuple(reasons), attempt - t0, ended, hints=tuple(hints)
        )


async def poll(poller: AsyncClient, t0: float, every_s: float, timeline: list[dict[str, float]]) -> None:
    """The governor's stats every `every_s` into `timeline`: the engine's busy seconds, the limits,
    the in-flight count, stamped from `t0`."""
    while True:
        s = await poller.stats()
        engine = s["workers"][0]["engine"]
        timeline.append(
            {
                "t": time.perf_counter() - t0,
                "busy": engine.get("busy_seconds_total", 0.0),
                "limit": s["max_inflight"],
                "adaptive": s["adaptive_limit"]["limit"],
                "inflight": s["inflight"],
            }
        )
        await asyncio.sleep(every_s)


async def drive(
    port: int,
    plan: list[Arrival],
    *,
    deadline_ms: float = 0.0,
    retry_for_s: float | None = None,
    victims_retry_for_s: float | None = None,
    retries: Callable[[Arrival], bool] | None = None,
    poll_s: float | None = None,
) -> Run:
    """Send every arrival of `plan` at its time over one connection, retrying yields for
    `retry_for_s` (only the arrivals `retries` picks, when given); with `poll_s`, `poll` reads the
    governor's stats that often on a second connection into the run's timeline."""
    timeline: list[dict[str, float]] = []
    async with AsyncClient(port=port, timeout=None, retry=NO_RETRY) as client:
        await client.connect()
        poller = AsyncClient(port=port) if poll_s else None  # no second connection unless asked for
        if poller is not None:
            await poller.connect()
        t0 = time.perf_counter()
        polling = asyncio.create_task(poll(poller, t0, poll_s or 0.0, timeline)) if poller is not None else None
        retry_until = None if retry_for_s is None else t0 + retry_for_s
        victim_until = None if victims_retry_for_s is None else t0 + victims_retry_for_s
        sends = (
            send(
                client, a, t0, deadline_ms=deadline_ms, victim_until=victim_until,
                retry_until=retry_until if retries is None or retries(a) else None,
            )
            for a in plan
        )  # fmt: skip
        try:
            outcomes = await asyncio.gather(*sends)
            wall = time.perf_counter() - t0
        finally:
            if polling is not None:
                polling.cancel()
            if poller is not None:
                await poller.aclose()
    return Run("", list(outcomes), wall, timeline)


class WorkerBench:
    """One standalone GPT-2 worker for a whole experiment, and a governor per configuration in front
    of it (`flags` on every one of them; logs in benchmarks/out/NAME_RUN.log)."""

    def __init__(self, name: str, args: argparse.Namespace, *flags: str) -> None:
        self.name = name
        self.args = args
        self.flags = flags
        self.worker, self.worker_port = start_gpt2_worker(name, args.model, args.threads, args.dtype)

    def governor(self, run: str, *flags: str) -> tuple[Popen[bytes], int]:
        return start_governor(
            *self.flags, "--integrity", "off", "--worker", f"127.0.0.1:{self.worker_port}", *flags,
            log=out_dir() / f"{self.name}_{run}.log",
        )  # fmt: skip

    def run(self, name: str, flags: list[str], plan: list[Arrival], **drive_options: Any) -> Run:
        """One configuration over `plan` (`drive`'s options), then a pause for the worker to drain."""
        proc, port = self.governor(name, *flags)
        try:
            run = asyncio.run(drive(port, plan, **drive_options))
            run.stats = stats(port)
        finally:
            stop(proc)
        run.name = name
        reasons = Counter(reason for o in run.outcomes for reason in o.reasons)
        finals = sum(o.final for o in run.outcomes)
        print(
            f"  {name}: {len(run.done())}/{len(plan)} done in {run.wall_s:.1f} s ({run.rps:.2f}/s), "
            f"yields {dict(reasons)} ({finals} final), errors {run.count('error')}\n"
            f"    hint outcomes {hint_outcomes(run.stats)}",
            flush=True,
        )
        time.sleep(1.0)  # let cancelled work drain from the worker before the next run
        return run

    def capacity(self, flags: list[str], clients: int, length: Callable[[random.Random], int]) -> float:
        """Completed requests/s of a closed loop of `clients` for half of `--seconds`, prompts of
        `length(rng)` tokens (the random models' tokenizer is bytes)."""
        proc, port = self.governor("capacity", *flags)

        async def closed() -> float:
            rng = random.Random(5)
            async with AsyncClient(port=port, timeout=None, retry=NO_RETRY) as client:
                await client.connect()
                done = 0
                t0 = time.perf_counter()
                end = t0 + self.args.seconds / 2

                async def loop() -> None:
                    nonlocal done
                    while time.perf_counter() < end:
                        n = length(rng)
                        await client.generate(
                            random_text(rng, n), max_new_tokens=MAX_NEW, temperature=0.0, stop_on_eos=False
                        )
                        done += 1

                await asyncio.gather(*(loop() for _ in range(clients)))
                return done / (time.perf_counter() - t0)

        try:
            rate = asyncio.run(closed())
        finally:
            stop(proc)
        print(f"  capacity: {rate:.2f} req/s", flush=True)
        time.sleep(1.0)
        return rate

    def close(self) -> None:
        stop(self.worker)


def finish(name: str, report: list[str], sittings: Iterable[Sitting]) -> None:
    """Print the experiment's report, keep it as benchmarks/out/NAME.md, and write every part's
    result file."""
    text = "\n".join(report)
    print(text)
    (out_dir() / f"{name}.md").write_text(text)
    for sitting in sittings:
        sitting.write()


def worker_options(parser: argparse.ArgumentParser) -> None:
    """The worker's options every such experiment takes."""
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
