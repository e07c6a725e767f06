"""The unmodified openai SDK at its defaults against llama.cpp's server under overload: directly
(llama-server queues every request) and through the governor's front door (429 with
`retry-after-ms`, which the SDK sleeps and retries at most twice), in the same sitting.

The question is the one an operator asks before putting the governor in front of a server: with
the clients people actually run, does telling some of them "no, come back in N ms" deliver more
requests within a latency objective than letting all of them queue, without costing tokens/s?
The reviewer's sitting (overload.py and sitting.sh) ported into the harness.

The setup, on a 2-core machine (unpinned where there is one core):
- `llama-server` (built by benchmarks/peers/llamacpp.py, once) serving GPT-2 small (random
  weights, a 50,257-entry BPE) as f32 GGUF: `--parallel P --cont-batching --threads 1
  --threads-batch 1 --ctx-size P*512`, pinned to core 0 (`taskset -c 0`);
- the governor: `governor serve --http-port PORT --worker "http://127.0.0.1:LP/v1,model=m,
  concurrency=P" --max-inflight P --integrity optional` and whatever `--governor-args` add,
  pinned to core 1 (it inherits this process's affinity);
- the load, this process on core 1: one `openai.AsyncOpenAI(base_url=..., api_key="unused",
  max_retries=2)` per run, its HTTP client the SDK's own default (`openai.DefaultAsyncHttpxClient`,
  the SDK's timeouts and connection limits) with event hooks that count every attempt and its
  status. Each request: `completions.create(model="m", prompt=<64 random characters>,
  max_tokens=M, stream=True, temperature=0.0, extra_body={"ignore_eos": True})`, its prompt
  distinct per target, load and round.

Capacity, measured first in the sitting: `P` SDK clients in a closed loop straight at
llama-server, each sending back to back for `--capacity-seconds` after one warm-up wave; capacity =
completed requests / seconds from the start to the last completion.

Per round, each load runs against both targets, direct first in odd rounds and the governor first
in even ones:
1. burst cold: `--burst` requests at once, the governor restarted just before (a fresh process:
   no service time seen, no forecast learnt); direct, the same burst at llama-server as it is;
2. burst warm: the same burst again, at the governor that served the cold one;
3. poisson: open-loop Poisson arrivals at `--overload` x capacity for `--seconds` (seeded by the
   round, the same arrivals for both targets).

Per run: completed / sent; the failures (a request whose `create` or stream raised: after the
SDK's retries, a `RateLimitError`), their exception types and how long after the request's first
attempt they raised (p50 / p99); TTFT p50 / p99 of the completed requests from the FIRST attempt
(a client told to come back pays for the wait); goodput = completed requests with TTFT <=
`--slo-ms` per second of the window (first send to last reply, a raise included); completion
tokens (the usage llama-server reports, relayed as is) per second of the window; HTTP attempts
and 429s as the SDK's own HTTP client saw them; and the governor's own counts (received,
executed, yielded by reason). Figures are medians over rounds, each beside the direct run of the
same rounds; ratios are medians of per-round ratios. Per-request records go to
benchmarks/out/sdk_overload.json (`--json` elsewhere).

    python -m benchmarks.peers.sdk_overload [--rounds 3] [--overload 2.5] [--seconds 20] [--burst 32]
                                            [--max-tokens 16] [--slo-ms 2000] [--parallel 8]
                                            [--governor-args "--promise-horizon-ms 1000"]
    make bench-sdk-overload
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import os
import random
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

import openai
import orjson

from benchmarks.harness import rounds as alternating
from benchmarks.harness.common import (
    machine,
    markdown_table,
    out_dir,
    random_text,
    start_front_door,
    stats,
    stop,
)
from benchmarks.harness.model_dir import ensure as ensure_model_dir
from benchmarks.harness.results import ROOT, Sitting
from benchmarks.peers import llamacpp
from governor.bench.stats import percentile

MODEL = "m"
DIRECT, GOVERNOR = "direct", "governor"
TARGETS = (DIRECT, GOVERNOR)
COLD, WARM, POISSON = "burst cold", "burst warm", "poisson"
LOADS = (COLD, WARM, POISSON)
SERVER_CORE, LOAD_CORE = 0, 1  # llama-server; the governor and the SDK load
BASELINE = "direct to llama-server"
SETTLE_S = 1.0  # between runs: the last run's connections closed, llama-server's slots idle


# -- one request ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    """One SDK call; times in seconds from its run's start (perf_counter)."""

    start: float  # the first attempt
    end: float = 0.0  # the last chunk, or the raise
    ok: bool = False
    ttft: float | None = None  # first attempt -> the first chunk with text
    tokens: int = 0
    error: str | None = None  # the exception's type
    message: str | None = None
    statuses: list[int] = field(default_factory=list)  # of each HTTP attempt, as the SDK's client saw it
    hints_ms: list[float] = field(default_factory=list)  # each 429's wait as the SDK reads it (NaN: none)
    sent: list[float] = field(default_factory=list)  # each attempt sent, seconds from the run's start
    answered: list[float] = field(default_factory=list)  # each attempt's response head, likewise

    @property
    def after(self) -> float:
        """How long after the first attempt it completed or raised."""
        return self.end - self.start


# The request an SDK call is for, and its run's start (perf_counter): asyncio gives each task its
# own context, so the HTTP client's hooks find the call they serve.
CURRENT: contextvars.ContextVar[tuple[Request, float] | None] = contextvars.ContextVar("request", default=None)


def sdk_wait_ms(headers: Any) -> float:
    """The wait a 429 asks for, read as the SDK reads it (`_parse_retry_after_header`):
    `retry-after-ms`, else `retry-after` in seconds; NaN where neither is a number."""
    for name, scale in (("retry-after-ms", 1.0), ("retry-after", 1000.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * scale
        except ValueError:
            continue
    return float("nan")


async def on_request(request: Any) -> None:
    """The SDK's HTTP client calls this as it sends each attempt: when."""
    current = CURRENT.get()
    if current is not None:
        current[0].sent.append(time.perf_counter() - current[1])


async def on_response(response: Any) -> None:
    """The SDK's HTTP client calls this for every attempt's response head: when, its status, and
    the wait of a 429."""
    current = CURRENT.get()
    if current is None:
        return
    request, t0 = current
    request.answered.append(time.perf_counter() - t0)
    request.statuses.append(response.status_code)
    if response.status_code == 429:
        request.hints_ms.append(sdk_wait_ms(response.headers))


def sdk_client(base_url: str) -> openai.AsyncOpenAI:
    """The SDK at its defaults, its HTTP client the one it would build itself plus the hooks."""
    http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=2, http_client=http_client)
    if client.max_retries != openai.DEFAULT_MAX_RETRIES or client.timeout != openai.DEFAULT_TIMEOUT:
        raise RuntimeError(f"the SDK is not at its defaults: {client.max_retries} retries, timeout {client.timeout}")
    return client


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, t0: float) -> Request:
    request = Request(start=time.perf_counter() - t0)
    CURRENT.set((request, t0))
    chunks = 0
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                if request.ttft is None:
                    request.ttft = time.perf_counter() - t0 - request.start
                chunks += 1
            if chunk.usage is not None:
                request.tokens = chunk.usage.completion_tokens
        request.tokens = request.tokens or chunks
        request.ok = request.ttft is not None
        if not request.ok:
            request.error, request.message = "NoText", "the stream ended without text"
    except Exception as exc:  # noqa: BLE001 - every failure is counted, by its kind
        request.error, request.message = type(exc).__name__, str(exc)[:200]
    request.end = time.perf_counter() - t0
    return request


async def drive(base_url: str, arrivals: list[float], prompts: list[str], max_tokens: int) -> list[Request]:
    """One request per arrival (seconds from the start), open loop, on one SDK client."""
    client = sdk_client(base_url)
    t0 = time.perf_counter()

    async def at(offset: float, prompt: str) -> Request:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await one(client, prompt, max_tokens, t0)

    try:
        return list(await asyncio.gather(*(at(a, p) for a, p in zip(arrivals, prompts, strict=True))))
    finally:
        await client.close()


async def closed_loop(base_url: str, clients: int, seconds: float, max_tokens: int) -> tuple[int, float]:
    """`clients` SDK callers sending back to back for `seconds` after one warm-up wave:
    (completed requests, seconds from the start to the last completion)."""
    client = sdk_client(base_url)
    rng = random.Random("capacity")
    try:
        warm = await asyncio.gather(*(one(client, random_text(rng, 64), max_tokens, 0.0) for _ in range(clients)))
        t0 = time.perf_counter()

        async def caller() -> list[Request]:
            done = []
            while time.perf_counter() - t0 < seconds:
                done.append(await one(client, random_text(rng, 64), max_tokens, t0))
            return done

        requests = [r for rs in await asyncio.gather(*(caller() for _ in range(clients))) for r in rs]
    finally:
        await client.close()
    failed = [r for r in [*warm, *requests] if not r.ok]
    if failed:
        raise RuntimeError(f"capacity: {len(failed)} requests failed straight at llama-server: {failed[0]}")
    return len(requests), max(r.end for r in requests)


# -- one run: a load against a target ---------------------------------------------------------------


def pct_ms(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else 1000 * value


@dataclass(slots=True)
class Run:
    load: str
    target: str
    requests: list[Request]
    slo_s: float
    governor: dict[str, Any] = field(default_factory=dict)  # the governor's counts over the run

    @property
    def sent(self) -> int:
        return len(self.requests)

    @property
    def done(self) -> list[Request]:
        return [r for r in self.requests if r.ok]

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    @property
    def completed(self) -> int:
        return len(self.done)

    @property
    def window_s(self) -> float:
        """First send to last reply (a raise is a reply)."""
        return max(r.end for r in self.requests) - min(r.start for r in self.requests)

    def ttft_ms(self, q: float) -> float | None:
        return pct_ms([r.ttft for r in self.done if r.ttft is not None], q)

    def failed_after_ms(self, q: float) -> float | None:
        return pct_ms([r.after for r in self.failed], q)

    @property
    def within_slo(self) -> int:
        return sum(1 for r in self.done if r.ttft is not None and r.ttft <= self.slo_s)

    @property
    def goodput(self) -> float:
        return self.within_slo / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.done) / self.window_s

    @property
    def attempts(self) -> int:
        return sum(len(r.statuses) for r in self.requests)

    @property
    def refusals(self) -> int:
        return sum(r.statuses.count(429) for r in self.requests)

    def failure_kinds(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for r in self.failed:
            kinds[r.error or "?"] = kinds.get(r.error or "?", 0) + 1
        return kinds

    def hint_ms(self, q: float) -> float | None:
        return percentile([h for r in self.requests for h in r.hints_ms if h == h], q)

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "completed": self.completed,
            "failed": len(self.failed),
            "failure_kinds": self.failure_kinds(),
            "failed_after_ms": {"p50": self.failed_after_ms(50), "p99": self.failed_after_ms(99)},
            "ttft_ms": {"p50": self.ttft_ms(50), "p90": self.ttft_ms(90), "p99": self.ttft_ms(99)},
            "within_slo": self.within_slo,
            "goodput_per_s": self.goodput,
            "tokens_per_s": self.tokens_per_s,
            "window_s": self.window_s,
            "attempts": self.attempts,
            "refusals_429": self.refusals,
            "retry_after_ms": {"p50": self.hint_ms(50), "max": self.hint_ms(100)},
            "governor": self.governor,
        }

    def line(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in self.failure_kinds().items())
        return (
            f"{self.load:>10} {self.target:>8}: {self.completed}/{self.sent} completed,"
            f" {len(self.failed)} failed{f' ({kinds})' if kinds else ''} after p50/p99"
            f" {fmt_ms(self.failed_after_ms(50))}/{fmt_ms(self.failed_after_ms(99))} ms,"
            f" TTFT p50/p99 {fmt_ms(self.ttft_ms(50))}/{fmt_ms(self.ttft_ms(99))} ms,"
            f" goodput {self.goodput:.2f}/s, {self.tokens_per_s:.1f} tok/s in {self.window_s:.1f} s;"
            f" {self.attempts} attempts, {self.refusals} 429s (retry-after-ms p50"
            f" {fmt_ms(self.hint_ms(50))}, max {fmt_ms(self.hint_ms(100))})"
            + (f"; governor {self.governor}" if self.governor else "")
        )


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def governor_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the governor counted over a run: its `*_total` counters, the reasons it yielded, refused
    for good and failed, the returns to appointments by outcome and the lobby's answers, as
    differences."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if key.endswith("_total") and isinstance(value, int) and value != before.get(key, 0):
            out[key.removesuffix("_total")] = value - int(before.get(key, 0))
        elif key in ("yielded_by_reason", "failed_by_reason", "final_by_reason") and isinstance(value, dict):
            then = before.get(key) or {}
            moved = {k: v - then.get(k, 0) for k, v in value.items() if v != then.get(k, 0)}
            if moved:
                out[key] = moved
    # whether the promises held: each return to an appointment by outcome, and the lobby's answers
    now_hints = (after.get("retry_hints") or {}).get("outcomes") or {}
    then_hints = (before.get("retry_hints") or {}).get("outcomes") or {}
    returns = {
        f"{reason} {outcome}": n - then_hints.get(reason, {}).get(outcome, 0)
        for reason, counts in now_hints.items()
        for outcome, n in counts.items()
        if n != then_hints.get(reason, {}).get(outcome, 0)
    }
    if returns:
        out["returns"] = returns
    held = (after.get("lobby") or {}).get("answered_total", 0) - (before.get("lobby") or {}).get("answered_total", 0)
    if held:
        out["lobby_answered"] = held
    return out


# -- processes --------------------------------------------------------------------------------------


def pinning() -> bool:
    return (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None


def start_llama_server(binary: Path, model: Path, parallel: int) -> tuple[Popen[bytes], int]:
    argv = [str(binary), "-m", str(model), "--parallel", str(parallel), "--cont-batching"]
    argv += ["--threads", "1", "--threads-batch", "1", "--ctx-size", str(parallel * 512), "--no-webui"]
    prefix = ("taskset", "-c", str(SERVER_CORE)) if pinning() else ()
    return llamacpp.launch_openai_server(argv, out_dir() / "sdk_overload_llama-server.log", prefix)


def start_governor(llama_port: int, parallel: int, governor_args: str) -> tuple[Popen[bytes], int, int]:
    """A fresh governor in front of llama-server (on this process's core), `--max-inflight` its
    slots and `governor_args` added: (process, NDJSON port, HTTP port)."""
    worker = f"http://127.0.0.1:{llama_port}/v1,model={MODEL},concurrency={parallel}"
    flags = ("--worker", worker, "--max-inflight", str(parallel), *shlex.split(governor_args))
    return start_front_door(*flags, log=out_dir() / "sdk_overload_governor.log", timeout=60)


@dataclass(frozen=True)
class LlamaSitting:
    """llama-server up for a sitting, and what was measured of it before any load."""

    port: int
    capacity: float  # req/s, the closed loop straight at it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@contextlib.contextmanager
def llama_sitting(args: argparse.Namespace) -> Iterator[LlamaSitting | None]:
    """The sitting's llama-server: built (once), pinned, started with `args.parallel` slots, its
    capacity measured (a closed loop of `args.parallel` SDK clients for `args.capacity_seconds`,
    `args.max_tokens` each); stopped on leaving. None, having said why, where it cannot be built."""
    work = out_dir() / "llamacpp"
    binary = work / "build" / "bin" / "llama-server"
    missing = llamacpp.missing_tools()
    if not binary.exists() and missing:
        print(f"skipped: {', '.join(missing)} not found (install CMake and a C++ compiler to build llama.cpp)")
        yield None
        return
    work.mkdir(parents=True, exist_ok=True)
    source = llamacpp.llama_source(work)
    binary = llamacpp.llama_server(work, source)
    model = llamacpp.gguf(work, source, ensure_model_dir(), "float32")
    if pinning():
        os.sched_setaffinity(0, {LOAD_CORE})  # the governor, started from here, inherits it
    print(f"machine: {machine()}; openai {openai.__version__}; pinned: {pinning()}", flush=True)
    llama, port = start_llama_server(binary, model, args.parallel)
    try:
        completed, seconds = asyncio.run(
            closed_loop(f"http://127.0.0.1:{port}/v1", args.parallel, args.capacity_seconds, args.max_tokens)
        )
        capacity = completed / seconds
        print(f"capacity: {completed} requests in {seconds:.1f} s = {capacity:.2f} req/s", flush=True)
        yield LlamaSitting(port, capacity)
    finally:
        stop(llama)


# -- the sitting ------------------------------------------------------------------------------------

Rounds = dict[str, list[dict[str, Run]]]  # load -> one {target: run} per round


def arrivals_of(load: str, round_: int, rate: float, args: argparse.Namespace) -> list[float]:
    if load != POISSON:
        return [0.0] * args.burst
    rng = random.Random(round_)
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) <= args.seconds:
        out.append(t)
    return out


def sitting_rounds(llama_port: int, capacity: float, args: argparse.Namespace) -> Rounds:
    results: Rounds = {load: [] for load in LOADS}
    governor: tuple[Popen[bytes], int, int] | None = None
    rate = args.overload * capacity
    try:
        for r in range(args.rounds):
            for load in LOADS:
                arrivals = arrivals_of(load, r + 1, rate, args)
                runs: dict[str, Run] = {}
                for target in alternating.order(r, TARGETS):  # round 1 (odd): direct first
                    if target == GOVERNOR and (load == COLD or governor is None):
                        if governor is not None:
                            stop(governor[0])
                        governor = None
                        governor = start_governor(llama_port, args.parallel, args.governor_args)
                    rng = random.Random(f"{r + 1} {load} {target}")  # distinct prompts: no cache hits
                    prompts = [random_text(rng, 64) for _ in arrivals]
                    if target == GOVERNOR:
                        assert governor is not None
                        _, port, http_port = governor
                        before = stats(port)
                        requests = asyncio.run(
                            drive(f"http://127.0.0.1:{http_port}/v1", arrivals, prompts, args.max_tokens)
                        )
                        counts = governor_counts(before, stats(port))
                    else:
                        url = f"http://127.0.0.1:{llama_port}/v1"
                        requests = asyncio.run(drive(url, arrivals, prompts, args.max_tokens))
                        counts = {}
                    run = Run(load, target, requests, args.slo_ms / 1000, counts)
                    runs[target] = run
                    print(f"round {r + 1} {run.line()}", flush=True)
                    time.sleep(SETTLE_S)
                results[load].append(runs)
    finally:
        if governor is not None:
            stop(governor[0])
    return results


# -- tables, figures, records -----------------------------------------------------------------------


def median(rs: list[dict[str, Run]], target: str, pick: Callable[[Run], float | None]) -> float | None:
    return alternating.median(rs, target, pick)


def cells(run_label: str, run: Run) -> list[str]:
    failed = len(run.failed)
    return [
        run.load,
        run_label,
        run.target,
        f"{run.completed}/{run.sent}",
        f"{failed} ({fmt_ms(run.failed_after_ms(50))} ms)" if failed else "0",
        f"{fmt_ms(run.ttft_ms(50))} / {fmt_ms(run.ttft_ms(99))}",
        f"{run.goodput:.2f}",
        f"{run.tokens_per_s:.1f}",
        f"{run.attempts} / {run.refusals}",
    ]


def median_cells(load: str, rs: list[dict[str, Run]], target: str) -> list[str]:
    """A target's row of medians over rounds."""

    def med(pick: Callable[[Run], float | None]) -> float | None:
        return median(rs, target, pick)

    return [
        load,
        "median",
        target,
        f"{fmt_ms(med(lambda r: r.completed))}/{fmt_ms(med(lambda r: r.sent))}",
        f"{fmt_ms(med(lambda r: len(r.failed)))} ({fmt_ms(med(lambda r: r.failed_after_ms(50)))} ms)",
        f"{fmt_ms(med(lambda r: r.ttft_ms(50)))} / {fmt_ms(med(lambda r: r.ttft_ms(99)))}",
        f"{med(lambda r: r.goodput) or 0:.2f}",
        f"{med(lambda r: r.tokens_per_s) or 0:.1f}",
        f"{fmt_ms(med(lambda r: r.attempts))} / {fmt_ms(med(lambda r: r.refusals))}",
    ]


HEADERS = [
    "load",
    "round",
    "target",
    "completed",
    "failed (after, p50)",
    "TTFT p50 / p99 from first attempt (ms)",
    "goodput (req/s, TTFT ≤ SLO)",
    "tokens/s",
    "attempts / 429s",
]


def tables(results: Rounds, args: argparse.Namespace) -> str:
    out = []
    for load in LOADS:
        rs = results[load]
        rows = [cells(str(i + 1), rnd[t]) for i, rnd in enumerate(rs) for t in TARGETS]
        if len(rs) > 1:
            rows += [median_cells(load, rs, t) for t in TARGETS]
        kinds: dict[str, int] = {}
        for rnd in rs:
            for t in TARGETS:
                for kind, n in rnd[t].failure_kinds().items():
                    kinds[f"{t}: {kind}"] = kinds.get(f"{t}: {kind}", 0) + n
        note = "failures: " + (", ".join(f"{k} × {n}" for k, n in kinds.items()) or "none")
        out.append(f"{load}:\n\n{markdown_table(HEADERS, rows)}\n\n{note}")
    return "\n\n".join(out)


def at_most(value: float | None, bar: float) -> bool | None:
    return None if value is None else value <= bar


def record(sitting: Sitting, results: Rounds, capacity: float, args: argparse.Namespace) -> None:
    """Medians over rounds, each beside the direct runs of the same rounds. Bars (issue 42): at
    `--overload` x capacity, goodput through the governor >= 4x direct and >= 0.8x capacity, its
    refusals answered within 100 ms (p50) and 1 s (p99), its completed TTFT p99 within the SLO,
    tokens/s >= 0.95x direct; in a burst, its refusals answered within 100 ms (p50). In the batch
    setting (`--governor-args` with a promise horizon past the SLO) those bars do not apply; a
    burst's are then >= 95% completed and a makespan <= 1.1x direct."""
    batch = batch_setting(args)

    def bar(text: str, met: bool | None) -> dict[str, Any]:
        """A bar of the interactive setting: none in the batch one."""
        return {} if batch else {"bar": text, "met": met}

    sitting.figure(
        f"capacity: llama-server, closed loop of {args.parallel} SDK clients", capacity, "req/s", headline=False
    )
    rs = results[POISSON]
    load = f"Poisson at {args.overload:g}x capacity"

    def both(pick: Callable[[Run], float | None]) -> tuple[float | None, tuple[str, float | None]]:
        return median(rs, GOVERNOR, pick), (BASELINE, median(rs, DIRECT, pick))

    value, base = both(lambda r: r.goodput)
    ratio = alternating.paired_ratio(rs, GOVERNOR, DIRECT, lambda r: r.goodput)
    direct_zero = base[1] == 0
    sitting.figure(
        f"goodput (TTFT <= {args.slo_ms:g} ms) through the governor, {load}",
        value,
        "req/s",
        baseline=base,
        ratio=ratio,
        **bar(">= 4x", (ratio >= 4) if ratio is not None else (bool(value) if direct_zero else None)),
        note="direct goodput 0 in every round" if ratio is None and direct_zero else "",
    )
    share = None if value is None or not capacity else value / capacity
    sitting.figure(
        f"goodput through the governor ÷ capacity, {load}",
        value,
        "req/s",
        baseline=("capacity (closed loop, direct)", capacity),
        ratio=share,
        **bar(">= 0.8x", None if share is None else share >= 0.8),
    )
    for q, limit in ((50, 100.0), (99, 1000.0)):
        value, base = both(lambda r, q=q: r.failed_after_ms(q))  # type: ignore[misc]
        sitting.figure(
            f"failed requests: raised after (p{q}, from the first attempt), through the governor, {load}",
            value,
            "ms",
            baseline=base,
            ratio=None,
            difference=None if value is None or base[1] is None else value - base[1],
            **bar(f"<= {limit:g} ms", at_most(value, limit)),
        )
    value, base = both(lambda r: r.ttft_ms(99))
    sitting.figure(
        f"TTFT p99 of completed requests (from the first attempt), through the governor, {load}",
        value,
        "ms",
        baseline=base,
        ratio=alternating.paired_ratio(rs, GOVERNOR, DIRECT, lambda r: r.ttft_ms(99)),
        **bar(f"<= {args.slo_ms:g} ms", at_most(value, args.slo_ms)),
    )
    value, base = both(lambda r: r.tokens_per_s)
    ratio = alternating.paired_ratio(rs, GOVERNOR, DIRECT, lambda r: r.tokens_per_s)
    sitting.figure(
        f"completion tokens/s through the governor, {load}",
        value,
        "tok/s",
        baseline=base,
        ratio=ratio,
        **bar(">= 0.95x", None if ratio is None else ratio >= 0.95),
    )
    for burst in (COLD, WARM):
        rs = results[burst]
        label = f"{burst} of {args.burst}"
        value, base = both(lambda r: r.completed)
        sitting.figure(f"requests completed through the governor, {label}", value, "requests", baseline=base)
        if batch:  # served whole rather than fast: how many, and how long the burst took
            share = None if value is None else 100.0 * value / args.burst
            sitting.figure(
                f"share of the burst completed through the governor, {label}",
                share,
                "%",
                bar=">= 95%",
                met=None if share is None else share >= 95.0,
            )
            value, base = both(lambda r: r.window_s)
            ratio = alternating.paired_ratio(rs, GOVERNOR, DIRECT, lambda r: r.window_s)
            sitting.figure(
                f"makespan through the governor, {label}",
                value,
                "s",
                baseline=base,
                ratio=ratio,
                bar="<= 1.1x",
                met=None if ratio is None else ratio <= 1.1,
            )
        value, base = both(lambda r: r.failed_after_ms(50))
        sitting.figure(
            f"failed requests: raised after (p50, from the first attempt), through the governor, {label}",
            value,
            "ms",
            baseline=base,
            ratio=None,
            difference=None if value is None or base[1] is None else value - base[1],
            **bar("<= 100 ms", at_most(value, 100.0)),
        )
        value, base = both(lambda r: r.goodput)
        sitting.figure(
            f"goodput (TTFT <= {args.slo_ms:g} ms) through the governor, {label}",
            value,
            "req/s",
            baseline=base,
            ratio=alternating.paired_ratio(rs, GOVERNOR, DIRECT, lambda r: r.goodput),
            headline=False,
        )


def batch_setting(args: argparse.Namespace) -> bool:
    """Whether `--governor-args` set a promise horizon past the SLO: the batch-job setting, where
    a burst is to be served whole rather than fast."""
    found = re.search(r"--promise-horizon-ms[= ]([0-9.]+)", args.governor_args)
    return found is not None and float(found.group(1)) > args.slo_ms


def variant(args: argparse.Namespace) -> str | None:
    """The result file's part: a run with other governor flags is a sitting of its own."""
    return re.sub(r"[^a-z0-9]+", "-", args.governor_args.lower()).strip("-") or None


def add_sitting_arguments(parser: argparse.ArgumentParser) -> None:
    """The llama-server sitting's flags (this script's and hint_policies'): rounds, the loads, the
    requests, the server's slots and the capacity measurement."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overload", type=float, default=2.5, help="Poisson rate, x the measured capacity")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long Poisson arrivals last")
    parser.add_argument("--burst", type=int, default=32, help="requests released at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="per request (ignore_eos: exactly that many)")
    parser.add_argument("--parallel", type=int, default=8, help="llama-server's slots, the governor's concurrency")
    parser.add_argument("--capacity-seconds", type=float, default=10.0, help="the closed loop measuring capacity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sitting_arguments(parser)
    parser.add_argument("--slo-ms", type=float, default=2000.0, help="the TTFT that counts toward goodput")
    parser.add_argument("--governor-args", default="", help="more governor flags, e.g. '--promise-horizon-ms 1000'")
    parser.add_argument("--json", type=Path, default=None, help="per-request records (default benchmarks/out/...)")
    args = parser.parse_args()
    sitting = Sitting(("govwire", "governor"), part=variant(args))
    with llama_sitting(args) as llama:
        if llama is None:
            return
        capacity = llama.capacity
        print(f"Poisson at {args.overload:g}x = {args.overload * capacity:.2f} req/s", flush=True)
        results = sitting_rounds(llama.port, capacity, args)

    command = "python -m benchmarks.peers.sdk_overload " + " ".join(sys.argv[1:])
    print(f"\ncommand: `{command.strip()}`\nmachine: {machine()}\n")
    print(
        f"llama-server (llama.cpp from {llamacpp.SDIST}) GPT-2 small f32, --parallel {args.parallel}, one thread"
        f"{', core 0' if pinning() else ''}; the governor --max-inflight {args.parallel}"
        f"{' ' + args.governor_args if args.governor_args else ''}{' and the load on core 1' if pinning() else ''};"
        f" openai {openai.__version__} at its"
        f" defaults (max_retries 2); {args.max_tokens} tokens per request; capacity {capacity:.2f} req/s; bursts of"
        f" {args.burst}; Poisson at {args.overload:g}x capacity for {args.seconds:g} s; SLO TTFT <= {args.slo_ms:g} ms;"
        f" {args.rounds} round(s)\n"
    )
    print(tables(results, args))
    print()

    raw = args.json or out_dir() / (f"sdk_overload-{sitting.part}.json" if sitting.part else "sdk_overload.json")
    per_round = [{load: {t: results[load][i][t] for t in TARGETS} for load in LOADS} for i in range(args.rounds)]
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_bytes(
        orjson.dumps(
            {
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "capacity_per_s": capacity,
                "rounds": [
                    {
                        load: {
                            t: {"summary": run.summary(), "requests": [asdict(q) for q in run.requests]}
                            for t, run in runs.items()
                        }
                        for load, runs in rnd.items()
                    }
                    for rnd in per_round
                ],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    print(f"per-request records: {raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw}")
    record(sitting, results, capacity, args)
    sitting.details = {
        "openai": openai.__version__,
        "llama_cpp": llamacpp.SDIST,
        "capacity_per_s": capacity,
        "poisson_rate_per_s": args.overload * capacity,
        "slo_ms": args.slo_ms,  # what goodput counts: the figures page's picture labels it
        "raw": str(raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw),
        "rounds": [{load: {t: run.summary() for t, run in rnd.items()} for load, rnd in r.items()} for r in per_round],
    }
    sitting.write()


if __name__ == "__main__":
    main()
