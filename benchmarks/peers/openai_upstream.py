"""The governor in front of a third-party OpenAI-compatible server: a burst straight at `transformers
serve`, and the same burst through the governor's front door with the server as an endpoint.

`transformers serve` (transformers' own FastAPI app, benchmarks/harness/fixtures/openai_server.py, its
default settings) serves the tiny GPT-2 the tests save (benchmarks/harness/fixtures/tiny_gpt2.py) on
the CPU. It generates one request at a time and queues the rest inside, each waiting stream already
holding its 200. A burst of `--burst` streaming `/v1/completions` requests (distinct prompts,
`max_tokens` `--max-tokens`, usage asked for) is released at once, each on a connection of its own:

- direct: at `transformers serve`;
- through the governor (`--http-port`, one endpoint `--worker http://.../v1,model=DIR,concurrency=K`)
  for each K of `--concurrency`: what K does not admit is answered 429 at once with
  `retry-after-ms`, and the client sleeps that long and sends again on the same connection, as the
  OpenAI SDKs do (without their limit of two retries); a 429 with `x-should-retry: false` (past
  the governor's promise horizon) ends the request, as it ends an SDK's. The issue's targets here
  are for a horizon past the burst's drain time: `--governor-args "--promise-horizon-ms 30000"`.
  429s are counted apart from errors (anything else that is not a whole stream).

TTFT is send -> the first SSE `data:` event (both servers' first event carries the first text):
from the request's first attempt (what its user waits) and, through the governor, from the attempt
that was admitted (what it waited inside the server). Throughput: completed requests and completion
tokens (the usage both servers report) per second of the burst, from its release to its last
completion.

The machine matters: on 2 cores, whatever else runs steals from the server. Two things are set
for that, the same for every configuration, and each burst's CPU seconds of the server, the
governor and the client are reported so that the cost stays visible:
- The server's torch runs one thread (`OMP_NUM_THREADS=1`; `--server-threads 0` leaves torch's
  default). With torch's default of one thread per core, identical direct bursts took 1.4 to 12.4 s
  (server CPU 2.5 to 12.9 s) in one sitting, and one took 49 s; with one thread, 1.5 to 2.9 s,
  following the tokens generated (measured while writing this benchmark).
- The client is cheap. httpx costs about 1.3 ms of CPU per request alone and 3.6 ms with 64
  connections open, so with K=1 its retries took 0.6 of a core and doubled the server's CPU per
  request. The default client (`--client raw`) is an asyncio protocol per request: pre-built request
  bytes, responses split by httptools, SSE lines split by hand. `--client httpx` runs the same
  bursts with `httpx.AsyncClient`.

Configurations take turns within each round (the first rotating); one server and one governor per
K serve the whole run, or, with `--fresh-governor`, a new governor for every burst through it, so
that each burst is the first its governor sees (a deploy, a restart, a scale-out: issue 60's target
is that burst's requests/s >= 0.8x direct at K=1 with `--promise-horizon-ms 30000`; only the
server is warmed up then). The tables give medians over rounds and medians of per-round ratios to
the direct burst of the same round.

    python -m benchmarks.peers.openai_upstream [--rounds 3] [--burst 64] [--max-tokens 32] [--concurrency 1 2 4]
                                               [--fresh-governor] [--governor-args "--promise-horizon-ms 30000"]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import orjson
import uvloop

from benchmarks.harness.common import (
    cpu_seconds,
    fmt,
    free_port,
    machine,
    markdown_table,
    out_dir,
    start_governor,
    stats,
    stop,
)
from benchmarks.harness.fixtures.openai_server import TransformersServe
from benchmarks.harness.fixtures.tiny_gpt2 import save_tiny_gpt2
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order
from benchmarks.harness.sse_burst_client import REFUSED_FOR_GOOD, Sample, one_httpx, one_raw
from governor.bench.stats import percentile
from governor.shell.config import GovernorConfig

DIRECT = "direct"
BATCH_HORIZON_MS = 10_000.0
"""A promise horizon past a burst's drain here (a few seconds): the issue's bars are for it."""


class Server(TransformersServe):
    """`transformers serve` with its torch limited to `threads` threads (0: torch's default)."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        super().__init__(model_dir)
        self.threads = threads

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env


# -- a burst -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Burst:
    """What one burst measured (TTFTs in ms) and the CPU seconds each process spent on it."""

    completed: int
    errors: dict[str, int]
    hints_ms: list[float]
    wall_s: float
    tokens: int
    ttft_first: list[float]
    ttft_admitted: list[float]
    cpu_s: dict[str, float] = field(default_factory=dict)  # server, governor, client

    @property
    def n_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def refusals(self) -> int:
        return len(self.hints_ms)

    @property
    def rps(self) -> float:
        return self.completed / self.wall_s

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s

    def p(self, which: str, q: float) -> float:
        value = percentile(getattr(self, which), q)
        return float("nan") if value is None else value

    def refusals_cell(self) -> str:
        """429s, and the median retry-after-ms they named."""
        hint = percentile(self.hints_ms, 50)
        return "0" if hint is None else f"{self.refusals:,} ({hint:,.0f})"

    def cpu_cell(self) -> str:
        return " / ".join(f"{self.cpu_s[k]:.1f}" if k in self.cpu_s else "-" for k in ("server", "governor", "client"))


async def burst(url: str, model: str, args: argparse.Namespace, round_: int) -> Burst:
    """`args.burst` requests released together."""
    bodies = [
        orjson.dumps(
            {
                "model": model,
                "prompt": f"{round_}.{i}: The quick brown fox jumps over the lazy dog.",
                "max_tokens": args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        for i in range(args.burst)
    ]
    gate = asyncio.Event()

    async def release(tasks: Sequence[Awaitable[Sample]]) -> tuple[list[Sample], float]:
        await asyncio.sleep(0.05)  # every task waiting at the gate
        t0 = time.perf_counter()
        gate.set()
        return list(await asyncio.gather(*tasks)), t0

    if args.client == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(args.timeout, connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            tasks = [asyncio.ensure_future(one_httpx(client, url, body, gate)) for body in bodies]
            samples, t0 = await release(tasks)
    else:
        tasks = [asyncio.ensure_future(one_raw(url, body, gate, args.timeout)) for body in bodies]
        samples, t0 = await release(tasks)
    ends = [s.done for s in samples if s.done is not None and s.error is None]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    return Burst(
        completed=len(ends),
        errors=errors,
        hints_ms=[h for s in samples for h in s.hints_ms],
        wall_s=(max(ends) if ends else time.perf_counter()) - t0,
        tokens=sum(s.tokens for s in samples if s.error is None),
        ttft_first=[t * 1000 for s in samples if (t := s.ttft_first) is not None],
        ttft_admitted=[t * 1000 for s in samples if (t := s.ttft_admitted) is not None],
    )


def measured(run: Callable[[], Burst], pids: dict[str, int]) -> Burst:
    """Run a burst and charge it the CPU seconds of the server and governor (/proc) and of this process."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client0 = time.process_time()
    result = run()
    result.cpu_s = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    result.cpu_s["client"] = time.process_time() - client0
    return result


# -- tables and the result file -----------------------------------------------------------------------


def median_of(rounds: list[dict[str, Burst]], c: str, pick: Callable[[Burst], float]) -> float:
    """The median over rounds of one configuration's figure."""
    return statistics.median(pick(r[c]) for r in rounds)


def ratio_to_direct(rounds: list[dict[str, Burst]], c: str, pick: Callable[[Burst], float]) -> float:
    """The median of per-round ratios to the direct burst of the same round."""
    return statistics.median(pick(r[c]) / pick(r[DIRECT]) for r in rounds)


def tables(rounds: list[dict[str, Burst]], configs: list[str], args: argparse.Namespace) -> str:
    def admitted(b: Burst, c: str, q: float) -> str:
        return "-" if c == DIRECT else fmt(b.p("ttft_admitted", q))

    detail = []
    for i, r in enumerate(rounds):
        for c in configs:
            b = r[c]
            detail.append(
                [
                    str(i + 1),
                    c,
                    f"{b.completed}/{args.burst}",
                    str(b.n_errors),
                    b.refusals_cell(),
                    f"{fmt(b.p('ttft_first', 50))} / {fmt(b.p('ttft_first', 99))}",
                    f"{admitted(b, c, 50)} / {admitted(b, c, 99)}",
                    f"{b.rps:.2f}",
                    f"{b.tps:.1f}",
                    f"{b.wall_s:.2f}",
                    b.cpu_cell(),
                ]
            )
    detail_headers = [
        "round",
        "config",
        "completed",
        "errors",
        "429s (retry-after-ms p50)",
        "TTFT p50 / p99 from first attempt (ms)",
        "TTFT p50 / p99 from admitted attempt (ms)",
        "requests/s",
        "tokens/s",
        "burst wall (s)",
        "CPU s: server / governor / client",
    ]

    med = partial(median_of, rounds)
    vs_direct = partial(ratio_to_direct, rounds)

    summary = []
    for c in configs:
        governed = c != DIRECT
        summary.append(
            [
                c,
                f"{sum(r[c].completed for r in rounds)}/{args.burst * len(rounds)}",
                str(sum(r[c].n_errors for r in rounds)),
                fmt(med(c, lambda b: b.refusals)),
                f"{fmt(med(c, lambda b: b.p('ttft_first', 50)))} / {fmt(med(c, lambda b: b.p('ttft_first', 99)))}",
                f"{fmt(med(c, lambda b: b.p('ttft_admitted', 50)))} / {fmt(med(c, lambda b: b.p('ttft_admitted', 99)))}"
                if governed
                else "-",
                f"{med(c, lambda b: b.rps):.2f}",
                f"{med(c, lambda b: b.tps):.1f}",
                f"{vs_direct(c, lambda b: b.p('ttft_first', 50)):.2f} /"
                f" {vs_direct(c, lambda b: b.p('ttft_first', 99)):.2f}"
                if governed
                else "-",
                f"{vs_direct(c, lambda b: b.rps):.2f}" if governed else "-",
                " / ".join(
                    f"{med(c, lambda b, k=k: b.cpu_s[k]):.1f}" if k in rounds[0][c].cpu_s else "-"  # type: ignore[misc]
                    for k in ("server", "governor", "client")
                ),
            ]
        )
    summary_headers = [
        "config",
        "completed",
        "errors",
        "429s per burst",
        "TTFT p50 / p99 from first attempt (ms)",
        "TTFT p50 / p99 from admitted attempt (ms)",
        "requests/s",
        "tokens/s",
        "TTFT p50 / p99 ÷ direct",
        "requests/s ÷ direct",
        "CPU s per burst: server / governor / client",
    ]
    # Rounds differ in the tokens their prompts lead to: compare each K with its own round's direct burst.
    best = max(configs[1:], key=lambda c: vs_direct(c, lambda b: b.rps))
    errors: dict[str, int] = {}
    for r in rounds:
        for c in configs:
            for kind, n in r[c].errors.items():
                errors[f"{c}: {kind}"] = errors.get(f"{c}: {kind}", 0) + n
    notes = f"\n\nmost requests/s through the governor (median of per-round ratios to direct): {best}"
    notes += f"; errors: {errors}" if errors else "; no errors"
    return (
        "per burst:\n\n"
        + markdown_table(detail_headers, detail)
        + "\n\nmedians over rounds (÷ direct: median of per-round ratios):\n\n"
        + markdown_table(summary_headers, summary)
        + notes
    )


def burst_row(b: Burst) -> dict[str, Any]:
    """One burst for the result file: its counts and percentiles, not its samples."""
    return {
        "completed": b.completed,
        "errors": b.errors,
        "refusals": b.refusals,
        "retry_after_ms_p50": percentile(b.hints_ms, 50),
        "ttft_first_ms": {"p50": b.p("ttft_first", 50), "p99": b.p("ttft_first", 99)},
        "ttft_admitted_ms": {"p50": b.p("ttft_admitted", 50), "p99": b.p("ttft_admitted", 99)},
        "requests_per_s": b.rps,
        "tokens_per_s": b.tps,
        "wall_s": b.wall_s,
        "cpu_s": b.cpu_s,
    }


def record(
    sitting: Sitting,
    rounds: list[dict[str, Burst]],
    configs: list[str],
    args: argparse.Namespace,
    on_time: dict[str, float | None],
) -> None:
    """Per K: requests/s beside the direct burst (headline), 429s per burst (bar <= 2 per request),
    TTFT p99 beside direct, the share of returns to an `endpoint_inflight` appointment admitted
    on time; the requests refused for good and the errors of every burst (headline). The issue's
    bars hold for a promise horizon past the burst's drain (`BATCH_HORIZON_MS`): requests/s >=
    0.8x at K=1 (every hand-over between two requests idles the serial server) and 0.9x above,
    TTFT p99 <= 1.15x at K >= 2, returns on time >= 95%; at a shorter horizon the governor tells
    most of a burst no for good at once, by design, and the figures carry no bar. The ratios are
    the tables' medians of per-round ratios."""
    direct_rps = median_of(rounds, DIRECT, lambda b: b.rps)
    batch = horizon_ms(args) >= BATCH_HORIZON_MS
    for c in configs[1:]:
        k = c.removeprefix("governor ")
        serial = k == "K=1"
        ratio = ratio_to_direct(rounds, c, lambda b: b.rps)
        sitting.figure(
            f"requests/s through the governor, {k}",
            median_of(rounds, c, lambda b: b.rps),
            "req/s",
            baseline=("direct to transformers serve", direct_rps),
            ratio=ratio,
            bar=None if not batch else ">= 0.8x" if serial else ">= 0.9x",
            met=None if not batch else ratio >= (0.8 if serial else 0.9),
        )
        refusals = median_of(rounds, c, lambda b: b.refusals)
        sitting.figure(
            f"429s per burst of {args.burst}, {k}",
            refusals,
            "429s",
            bar="<= 2 per request",
            met=refusals <= 2 * args.burst,
            headline=False,
        )
        ttft_ratio = ratio_to_direct(rounds, c, lambda b: b.p("ttft_first", 99))
        sitting.figure(
            f"TTFT p99 from the first attempt, {k}",
            median_of(rounds, c, lambda b: b.p("ttft_first", 99)),
            "ms",
            baseline=("direct to transformers serve", median_of(rounds, DIRECT, lambda b: b.p("ttft_first", 99))),
            ratio=ttft_ratio,
            bar=None if serial or not batch else "<= 1.15x",
            met=None if serial or not batch else ttft_ratio <= 1.15,
            headline=False,
        )
        share = on_time.get(c)
        if share is not None:
            sitting.figure(
                f"returns to an endpoint_inflight appointment admitted on time, {k}",
                100.0 * share,
                "%",
                bar=">= 95%" if batch else None,
                met=share >= 0.95 if batch else None,
                headline=False,
                note="the governor's retry-hint outcomes over the whole run (warm-up included)",
            )
    final = sum(r[c].errors.get(REFUSED_FOR_GOOD, 0) for r in rounds for c in configs)
    errors = sum(r[c].n_errors for r in rounds for c in configs) - final
    sitting.figure("refused for good (past the promise horizon), all bursts through the governor", final, "requests")
    sitting.figure("errors, all bursts, direct and through the governor", errors, "requests")
    sitting.details = {"rounds": [{c: burst_row(r[c]) for c in configs} for r in rounds]}


def horizon_ms(args: argparse.Namespace) -> float:
    """The governor's --promise-horizon-ms as `--governor-args` sets it, else its default."""
    words = args.governor_args.split()
    for i, word in enumerate(words):
        if word == "--promise-horizon-ms" and i + 1 < len(words):
            return float(words[i + 1])
        if word.startswith("--promise-horizon-ms="):
            return float(word.partition("=")[2])
    return GovernorConfig().promise_horizon_ms


def variant(args: argparse.Namespace) -> str | None:
    """The result file's part: a run with other governor flags, a global cap or the httpx client is a
    sitting of its own beside the default one (the sittings report fixed hints apart)."""
    words = [args.governor_args, "global cap" if args.global_cap else "", "" if args.client == "raw" else args.client]
    words.append("fresh governor" if args.fresh_governor else "")
    return re.sub(r"[^a-z0-9]+", "-", " ".join(words).lower()).strip("-") or None


@dataclass
class Governors:
    """The governor of each K in front of the server: started when first asked for and kept for the
    whole run, or (`fresh`) retired after each burst, so that every burst meets a governor that has
    seen no stream of its endpoint (a deploy, a restart, a scale-out). What each governor counted
    is printed as it retires; the returns to `endpoint_inflight` appointments add up over the run."""

    server: Server
    args: argparse.Namespace
    running: dict[str, tuple[Popen[bytes], int, int]] = field(default_factory=dict)
    returns: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> outcome -> count

    def target(self, name: str) -> tuple[str, dict[str, int]]:
        """The completions URL of `name`'s governor (started if it is not running) and the pids to charge."""
        if name not in self.running:
            k = int(name.removeprefix("governor K="))
            http_port = free_port()
            worker = f"{self.server.base_url},model={self.server.model},concurrency={k}"
            flags = ["--worker", worker, "--http-port", str(http_port), "--integrity", "optional"]
            if self.args.global_cap:
                flags += ["--max-inflight", str(k)]
            flags += self.args.governor_args.split()
            proc, port = start_governor(*flags, log=out_dir() / f"openai_upstream_k{k}.log", timeout=60)
            self.running[name] = (proc, port, http_port)
        proc, _, http_port = self.running[name]
        assert self.server.pid is not None
        return f"http://127.0.0.1:{http_port}/v1/completions", {"server": self.server.pid, "governor": proc.pid}

    def retire(self, name: str) -> None:
        proc, port, _ = self.running.pop(name)
        try:
            s = stats(port)
        finally:
            stop(proc)
        outcomes = s["retry_hints"]["outcomes"].get("endpoint_inflight", {})
        total = self.returns.setdefault(name, {})
        for outcome, n in outcomes.items():
            total[outcome] = total.get(outcome, 0) + n
        probes = [w.get("probe") for w in s.get("workers", []) if w.get("probe")]
        yielded = {k: v for k, v in s["yielded_by_reason"].items() if v}
        failed = {k: v for k, v in s["failed_by_reason"].items() if v}
        print(
            f"{name} accounting: received={s['received_total']} executed={s['executed_total']}"
            f" yielded={s['yielded_total']} {yielded} failed={s['failed_total']} {failed}"
            f" rejected={s['rejected_total']}; endpoint_inflight returns {outcomes}; probe {probes}",
            flush=True,
        )

    def close(self) -> None:
        for name in list(self.running):
            self.retire(name)

    def on_time(self) -> dict[str, float | None]:
        """Per governor: the share of its returns to an `endpoint_inflight` appointment admitted on time."""
        shares: dict[str, float | None] = {}
        for name, outcomes in self.returns.items():
            returns = sum(outcomes.get(o, 0) for o in ("on_time", "early", "late", "yielded_again"))
            shares[name] = outcomes.get("on_time", 0) / returns if returns else None
        return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=64, help="requests released at once")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request (the tiny model has 128 positions)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="the endpoint's K to try")
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw", help="see above")
    parser.add_argument("--timeout", type=float, default=300.0, help="a request's time limit (s): a stall is an error")
    parser.add_argument("--server-threads", type=int, default=1, help="the server's torch threads; 0: torch's default")
    parser.add_argument(
        "--global-cap", action="store_true", help="also pass --max-inflight K (by default only the endpoint has K)"
    )
    parser.add_argument(
        "--governor-args", default="", help="more governor flags, e.g. '--retry-hint fixed --retry-hint-ms 20'"
    )
    parser.add_argument(
        "--fresh-governor",
        action="store_true",
        help="a new governor for every burst through it: each burst is its first",
    )
    args = parser.parse_args()
    sitting = Sitting(("govwire", "governor"), part=variant(args))
    command = "python -m benchmarks.peers.openai_upstream " + " ".join(sys.argv[1:])
    configs = [DIRECT, *(f"governor K={k}" for k in args.concurrency)]
    with tempfile.TemporaryDirectory(prefix="openai-upstream-") as tmp:
        model_dir = save_tiny_gpt2(Path(tmp) / "tiny-gpt2")
        server = Server(model_dir, args.server_threads).start()
        governors = Governors(server, args)
        try:
            assert server.pid is not None
            # The front door serves an OpenAI endpoint under that endpoint's model name (--served-model
            # names the worker endpoints), so clients send the same `model` both ways.
            direct = (f"{server.base_url}/completions", {"server": server.pid})
            warm = argparse.Namespace(**{**vars(args), "burst": 4})
            # The server's first requests are slow: each path once (a fresh governor's only through the server).
            for name in configs if not args.fresh_governor else [DIRECT]:
                uvloop.run(burst(direct[0] if name == DIRECT else governors.target(name)[0], server.model, warm, 0))
            rounds: list[dict[str, Burst]] = []
            for i in range(args.rounds):
                results: dict[str, Burst] = {}
                for name in order(i, configs, rotate=True):
                    url, pids = direct if name == DIRECT else governors.target(name)
                    b = measured(partial(uvloop.run, burst(url, server.model, args, i + 1)), pids)
                    results[name] = b
                    print(
                        f"round {i + 1} {name}: {b.completed}/{args.burst} completed, {b.n_errors} errors,"
                        f" 429s {b.refusals_cell()}, TTFT p50/p99 {b.p('ttft_first', 50):,.0f}/"
                        f"{b.p('ttft_first', 99):,.0f} ms (admitted attempt {b.p('ttft_admitted', 50):,.0f}/"
                        f"{b.p('ttft_admitted', 99):,.0f}), {b.rps:.2f} req/s, {b.tps:.1f} tok/s in {b.wall_s:.2f} s,"
                        f" CPU s server/governor/client {b.cpu_cell()}",
                        flush=True,
                    )
                    if args.fresh_governor and name != DIRECT:
                        governors.retire(name)
                rounds.append(results)
            governors.close()
        finally:
            for proc, _, _ in governors.running.values():
                stop(proc)
            server.stop()
    print(f"\ncommand: `{command.strip()}`\nmachine: {machine()}\n")
    print(
        f"`transformers serve` (its defaults, CPU, torch threads: {args.server_threads or 'default'}) serving the tiny"
        " GPT-2 of benchmarks/harness/fixtures/tiny_gpt2.py; bursts of"
        f" {args.burst} streaming requests, max_tokens {args.max_tokens}, {args.client} client; {args.rounds} rounds;"
        f" {'--max-inflight K' if args.global_cap else 'default --max-inflight (32)'}"
        f"{'; a fresh governor for every burst through it' if args.fresh_governor else ''}\n"
    )
    print(tables(rounds, configs, args))
    record(sitting, rounds, configs, args, governors.on_time())
    sitting.write()


if __name__ == "__main__":
    main()
