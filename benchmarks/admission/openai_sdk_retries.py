"""Whether the real `openai` Python SDK, left at its default `max_retries` (2), gets its requests
through an overloaded governor on the retry hints alone.

An SDK client gives up after three attempts. The governor's 429s carry `retry-after-ms`, which the
SDK sleeps, and a `retry-ticket` header, which the SDK does not send back; the governor also
recognises a client that re-sends the identical body, so a refused SDK request holds an appointment
for the slot it was told about. If the hints were short guesses, two retries would burn through
them and the SDK would raise `RateLimitError` to its caller: this benchmark measures whether they
hold. The issue's target: a burst of 64 SDK clients at twice capacity, >= 95% complete and
<= 2.0 attempts per completed request.

One governor per run (`--http-port`, `--integrity optional`, `--max-inflight N` from the option),
with its spawned echo worker answering `--max-tokens` tokens `--token-delay-ms` apart, so that a
request holds its slot ~0.3 s by default. Each client is a thread with its own `openai.OpenAI`
(default `max_retries`, its default HTTP client settings) whose HTTP attempts are counted by
event hooks on its HTTP client, along with each response's status, `retry-after-ms` and whether
it carried a `retry-ticket`. Every request's prompt is distinct (two identical bodies would be one
client to the governor). Requests are `POST /v1/completions`, not streamed.

Scenarios (each on a fresh governor):
- burst: `--clients` clients, released together by a barrier, each send one completion, after
  `--warmup` requests ended (so the release forecast has seen a service time);
- burst-cold: the same burst as the governor's first requests;
- sustained: the same clients in a closed loop for `--seconds` s each (after the warm-up), each
  request sent when the previous one returned or raised.

Per run: requests completed / sent, attempts per completed request (all HTTP attempts, of completed
and failed requests alike, over the completed ones: what a completion costs in requests), 429s and
the median `retry-after-ms` they named, the share of them with a `retry-ticket`, how long after
the time it was given the SDK sent each retry (429 received -> retry's request hook, less
`retry-after-ms`: the client's own lateness, which on a small machine running all the clients is
mostly their CPU), the latency from a request's first attempt to its completion, and the governor's
own counts: HTTP requests received (which should equal the attempts counted here), and its
`retry_hints` stats: the outcome of each hint by the limit that booked it (on_time / early / late /
yielded_again / never), the appointments still open and `forecast_relative_error_p50`. A `late`
return costs the SDK nothing when the slot is free by then (it is admitted as a new client); a
`yielded_again` costs it one of its two retries. Scenarios take turns within a round (the first
rotating); the summary gives medians over rounds.

    python -m benchmarks.admission.openai_sdk_retries [--rounds 3] [--clients 64] [--max-inflight 32]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from benchmarks.harness.common import free_port, machine, markdown_table, out_dir, start_governor, stats, stop
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import median, order
from governor.bench.stats import percentile

MODEL = "gpt2"  # the governor's default --served-model
BURST, BURST_COLD, SUSTAINED = "burst", "burst-cold", "sustained"
SCENARIOS = (BURST, BURST_COLD, SUSTAINED)
OUTCOMES = ("on_time", "early", "late", "yielded_again", "never")


@dataclass(slots=True)
class Request:
    """One SDK call: its HTTP attempts as the event hooks saw them; times on perf_counter."""

    started: float
    attempts: int = 0
    statuses: list[int] = field(default_factory=list)
    hints_ms: list[float] = field(default_factory=list)  # retry-after-ms of each 429
    tickets: int = 0  # 429s that carried a retry-ticket
    lateness_ms: list[float] = field(default_factory=list)  # each retry's send - (its 429 + retry-after-ms)
    refused_at: float | None = None  # when the last 429 arrived, until the retry is sent
    done: float | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.done is not None and self.error is None


class Hooks:
    """The attempts of a client thread's current request, from its HTTP client's event hooks. The
    arguments are the SDK's httpx (or httpx2, by SDK version) request and response."""

    def __init__(self) -> None:
        self.current: Request | None = None

    def on_request(self, request: Any) -> None:
        current = self.current
        if current is None:
            return
        current.attempts += 1
        if current.refused_at is not None:
            waited_ms = (time.perf_counter() - current.refused_at) * 1000
            current.lateness_ms.append(waited_ms - current.hints_ms[-1])
            current.refused_at = None

    def on_response(self, response: Any) -> None:
        current = self.current
        if current is None:
            return
        current.statuses.append(response.status_code)
        if response.status_code == 429:
            hint = response.headers.get("retry-after-ms")
            current.hints_ms.append(float(hint) if hint is not None else math.nan)
            current.tickets += "retry-ticket" in response.headers
            current.refused_at = time.perf_counter()


def sdk_client(port: int, hooks: Hooks, timeout_s: float, **options: Any) -> openai.OpenAI:
    """An SDK client of its own (default max_retries unless `options` say), its HTTP client the
    SDK's default one with the hooks."""
    http_client = openai.DefaultHttpxClient(
        timeout=timeout_s, event_hooks={"request": [hooks.on_request], "response": [hooks.on_response]}
    )
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=timeout_s, http_client=http_client, **options
    )


def complete(client: openai.OpenAI, hooks: Hooks, prompt: str, max_tokens: int) -> Request:
    """One completion through the SDK, its retries its own."""
    request = hooks.current = Request(time.perf_counter())
    try:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        text = result.choices[0].text if result.choices else None
        if text != prompt[:max_tokens]:
            request.error = f"wrong text {text!r}"
    except openai.APIStatusError as exc:
        request.error = f"{type(exc).__name__} {exc.status_code}"
    except openai.APIError as exc:  # connection errors, timeouts
        request.error = type(exc).__name__
    request.done = time.perf_counter()
    hooks.current = None
    return request


def prompt_of(scenario: str, round_: int, client: int, n: int) -> str:
    """A distinct prompt, its first bytes (what the echo worker answers) marking it."""
    return f"{client}.{n}.{round_} {scenario}: the quick brown fox jumps over the lazy dog"


def pct(values: list[float], q: float) -> float:
    """A percentile, NaN for none (a 429 without `retry-after-ms` is left out)."""
    value = percentile([v for v in values if not math.isnan(v)], q)
    return math.nan if value is None else value


@dataclass(slots=True)
class Run:
    """One scenario on one governor."""

    scenario: str
    requests: list[Request]
    wall_s: float
    received_http: int  # by the governor during the run (its warm-up excluded)
    retry_hints: dict[str, Any]
    first_failure: str | None = None  # what the last 429 of a failed request said

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def completed(self) -> int:
        return sum(r.completed for r in self.requests)

    @property
    def share(self) -> float:
        return self.completed / self.n if self.n else math.nan

    @property
    def attempts(self) -> int:
        return sum(r.attempts for r in self.requests)

    @property
    def attempts_per_completed(self) -> float:
        return self.attempts / self.completed if self.completed else math.nan

    @property
    def refusals(self) -> int:
        return sum(len(r.hints_ms) for r in self.requests)

    @property
    def tickets(self) -> int:
        return sum(r.tickets for r in self.requests)

    def hint_ms(self, q: float) -> float:
        return pct([h for r in self.requests for h in r.hints_ms], q)

    def lateness_ms(self, q: float) -> float:
        return pct([x for r in self.requests for x in r.lateness_ms], q)

    def latency_ms(self, q: float) -> float:
        return pct([(r.done - r.started) * 1000 for r in self.requests if r.completed and r.done], q)

    def errors(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests:
            if r.error:
                out[r.error] = out.get(r.error, 0) + 1
        return out

    def outcomes(self) -> str:
        """The governor's hint outcomes for the in-flight cap: on_time/early/late/yielded_again/never."""
        counts = self.retry_hints.get("outcomes", {}).get("inflight", {})
        return "/".join(str(counts.get(o, 0)) for o in OUTCOMES)

    def forecast_error(self) -> str:
        value = self.retry_hints.get("forecast_relative_error_p50")
        return "-" if value is None else f"{value:.3f}"

    def figures(self) -> dict[str, Any]:
        """The run's row as numbers, for the result file."""
        return {
            "completed": self.completed,
            "sent": self.n,
            "attempts_per_completed": self.attempts_per_completed,
            "refusals": self.refusals,
            "refusals_with_ticket": self.tickets,
            "retry_after_ms_p50": self.hint_ms(50),
            "retry_after_ms_max": self.hint_ms(100),
            "retry_lateness_ms_p50": self.lateness_ms(50),
            "retry_lateness_ms_p99": self.lateness_ms(99),
            "latency_ms_p50": self.latency_ms(50),
            "latency_ms_p99": self.latency_ms(99),
            "completed_per_s": self.completed / self.wall_s,
            "governor_received_http": self.received_http,
            "retry_hints": self.retry_hints,
            "errors": self.errors(),
        }


def warm_up(port: int, n: int, args: argparse.Namespace) -> None:
    """`n` requests, one after another, before the clients start: the forecast sees service times."""
    hooks = Hooks()
    with sdk_client(port, hooks, args.timeout, max_retries=0) as client:
        for i in range(n):
            r = complete(client, hooks, prompt_of("warm-up", 0, 0, i), args.max_tokens)
            if not r.completed:
                raise RuntimeError(f"warm-up request failed: {r.error}")


def run_clients(port: int, scenario: str, round_: int, args: argparse.Namespace) -> tuple[list[Request], float]:
    """`args.clients` threads, released together; a burst sends one request each, sustained loops."""
    barrier = threading.Barrier(args.clients + 1)
    results: list[list[Request]] = [[] for _ in range(args.clients)]
    deadline: list[float] = [0.0]

    def client_thread(i: int) -> None:
        hooks = Hooks()
        with sdk_client(port, hooks, args.timeout) as client:
            assert client.max_retries == 2  # the SDK's default
            barrier.wait()
            n = 0
            while True:
                results[i].append(complete(client, hooks, prompt_of(scenario, round_, i, n), args.max_tokens))
                n += 1
                if scenario != SUSTAINED or time.perf_counter() >= deadline[0]:
                    return

    threads = [threading.Thread(target=client_thread, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    deadline[0] = time.perf_counter() + args.seconds + 5.0  # until the barrier below opens
    barrier.wait()
    t0 = time.perf_counter()
    deadline[0] = t0 + args.seconds
    for t in threads:
        t.join(args.timeout * 3 + args.seconds + 30)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{scenario}: a client thread did not end")
    requests = [r for rs in results for r in rs]
    ends = [r.done for r in requests if r.done is not None]
    return requests, (max(ends) if ends else time.perf_counter()) - t0


def run(scenario: str, round_: int, args: argparse.Namespace) -> Run:
    http_port = free_port()
    flags = ["--http-port", str(http_port), "--integrity", "optional", "--max-inflight", str(args.max_inflight)]
    flags += args.governor_args.split()
    worker = ("--token-delay-ms", str(args.token_delay_ms))
    proc, port = start_governor(*flags, worker_args=worker, log=out_dir() / "openai_sdk_retries.log")
    try:
        if scenario != BURST_COLD:
            warm_up(http_port, args.warmup, args)
        before = stats(port)["received_by_protocol"]["http"]
        requests, wall_s = run_clients(http_port, scenario, round_, args)
        s = stats(port)
    finally:
        stop(proc)
    result = Run(scenario, requests, wall_s, s["received_by_protocol"]["http"] - before, s.get("retry_hints", {}))
    failed = [r for r in requests if r.error]
    if failed:
        r = failed[0]
        result.first_failure = (
            f"{r.error} after {r.attempts} attempts, statuses {r.statuses}, retry-after-ms {r.hints_ms},"
            f" with retry-ticket {r.tickets}/{len(r.hints_ms)}"
        )
    return result


# -- tables ------------------------------------------------------------------------------------------


def row(label: str, r: Run) -> list[str]:
    return [
        label,
        r.scenario,
        f"{r.completed}/{r.n} ({100 * r.share:.1f}%)",
        f"{r.attempts_per_completed:.2f}",
        f"{r.refusals} ({r.hint_ms(50):.0f} / {r.hint_ms(100):.0f})" if r.refusals else "0",
        f"{r.tickets}/{r.refusals}",
        f"{r.lateness_ms(50):.1f} / {r.lateness_ms(99):.1f}" if r.refusals else "-",
        f"{r.latency_ms(50):,.0f} / {r.latency_ms(99):,.0f}",
        f"{r.completed / r.wall_s:.1f}",
        f"{r.received_http}/{r.attempts}",
        r.outcomes(),
        r.forecast_error(),
    ]


HEADERS = [
    "round",
    "scenario",
    "completed",
    "attempts per completed",
    "429s (retry-after-ms p50 / max)",
    "429s with retry-ticket",
    "retry sent after retry-after-ms p50 / p99 (ms)",
    "latency p50 / p99 (ms)",
    "completed/s",
    "governor received / attempts counted",
    "hint outcomes on_time/early/late/yielded_again/never",
    "forecast rel. error p50",
]


def tables(rounds: list[dict[str, Run]], scenarios: list[str]) -> str:
    detail = [row(str(i + 1), r[s]) for i, r in enumerate(rounds) for s in scenarios]

    def med(s: str, pick: Callable[[Run], float]) -> float:
        return statistics.median(pick(r[s]) for r in rounds)

    summary = []
    for s in scenarios:
        runs = [r[s] for r in rounds]
        completed, sent = sum(r.completed for r in runs), sum(r.n for r in runs)
        errors: dict[str, int] = {}
        for r in runs:
            for kind, n in r.errors().items():
                errors[kind] = errors.get(kind, 0) + n
        summary.append(
            [
                s,
                f"{100 * med(s, lambda r: r.share):.1f}% ({completed}/{sent} in all)",
                f"{med(s, lambda r: r.attempts_per_completed):.2f}",
                f"{med(s, lambda r: r.refusals):.0f}",
                f"{med(s, lambda r: r.hint_ms(50)):.0f}",
                f"{med(s, lambda r: r.lateness_ms(50)):.1f} / {med(s, lambda r: r.lateness_ms(99)):.1f}",
                f"{med(s, lambda r: r.latency_ms(50)):,.0f} / {med(s, lambda r: r.latency_ms(99)):,.0f}",
                f"{med(s, lambda r: r.completed / r.wall_s):.1f}",
                ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none",
            ]
        )
    summary_headers = [
        "scenario",
        "completed (median share)",
        "attempts per completed",
        "429s per run",
        "retry-after-ms p50",
        "retry sent after retry-after-ms p50 / p99 (ms)",
        "latency p50 / p99 (ms)",
        "completed/s",
        "errors (all rounds)",
    ]
    return (
        "per run:\n\n"
        + markdown_table(HEADERS, detail)
        + "\n\nmedians over rounds:\n\n"
        + markdown_table(summary_headers, summary)
    )


def record(sitting: Sitting, rounds: list[dict[str, Run]], scenarios: list[str], args: argparse.Namespace) -> None:
    """Medians over rounds per scenario. The bars: the issue's for the burst (>= 95% complete, <= 2.0
    attempts per completed request) and docs section 12's for the forecast (error p50 <= 20%)."""
    load = f"{args.clients} at {args.clients / args.max_inflight:g}x capacity"
    labels = {BURST: f"burst of {load}", BURST_COLD: f"cold burst of {load}", SUSTAINED: f"sustained, {load}"}
    for s in scenarios:
        label, burst = labels[s], s == BURST
        share = median(rounds, s, lambda r: r.share)
        sitting.figure(
            f"SDK requests completed, {label}", None if share is None else 100 * share, "%",
            bar=">= 95%" if burst else None, met=share >= 0.95 if burst and share is not None else None,
        )  # fmt: skip
        attempts = median(rounds, s, lambda r: r.attempts_per_completed)
        sitting.figure(
            f"SDK attempts per completed request, {label}", attempts, "attempts",
            bar="<= 2.0" if burst else None, met=attempts <= 2.0 if burst and attempts is not None else None,
            headline=burst,
        )  # fmt: skip
        forecast = median(rounds, s, lambda r: r.retry_hints.get("forecast_relative_error_p50"))
        sitting.figure(
            f"release forecast error p50 (of a service time), {label}", None if forecast is None else 100 * forecast,
            "%", bar="<= 20%", met=None if forecast is None else forecast <= 0.2, headline=False,
        )  # fmt: skip
        sitting.figure(f"retry-after-ms p50, {label}", median(rounds, s, lambda r: r.hint_ms(50)), "ms", headline=False)
        sitting.figure(f"latency p99, {label}", median(rounds, s, lambda r: r.latency_ms(99)), "ms", headline=False)
    sitting.details = {
        "openai": openai.__version__,
        "rounds": [{s: r.figures() for s, r in results.items()} for results in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64, help="SDK clients, one thread each")
    parser.add_argument("--max-inflight", type=int, default=32, help="the governor's cap (clients / 2: twice capacity)")
    parser.add_argument("--max-tokens", type=int, default=16, help="per request")
    parser.add_argument("--token-delay-ms", type=float, default=20.0, help="the echo worker's delay between tokens")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long sustained clients keep sending")
    parser.add_argument("--warmup", type=int, default=2, help="requests ended before burst and sustained start")
    parser.add_argument("--timeout", type=float, default=30.0, help="the SDK's timeout per attempt (s)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--governor-args", default="", help="more governor flags, e.g. '--appointment-grace-ms 100'")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor"))
    command = "python -m benchmarks.admission.openai_sdk_retries " + " ".join(sys.argv[1:])
    scenarios: list[str] = args.scenarios
    rounds: list[dict[str, Run]] = []
    for i in range(args.rounds):
        results: dict[str, Run] = {}
        for scenario in order(i, scenarios, rotate=True):
            r = run(scenario, i + 1, args)
            results[scenario] = r
            errors = r.errors()
            print(
                f"round {i + 1} {scenario}: {r.completed}/{r.n} completed ({100 * r.share:.1f}%),"
                f" {r.attempts_per_completed:.2f} attempts per completed, {r.refusals} 429s"
                f" (retry-after-ms p50 {r.hint_ms(50):.0f}, max {r.hint_ms(100):.0f}; retry-ticket on"
                f" {r.tickets}; retries sent {r.lateness_ms(50):.1f}/{r.lateness_ms(99):.1f} ms p50/p99 after it),"
                f" latency p50/p99 {r.latency_ms(50):,.0f}/{r.latency_ms(99):,.0f} ms,"
                f" {r.wall_s:.2f} s; governor received {r.received_http} (attempts counted {r.attempts});"
                f" retry_hints {r.retry_hints}"
                + (f"; errors {errors}; first failure: {r.first_failure}" if errors else ""),
                flush=True,
            )
        rounds.append(results)
    print(f"\ncommand: `{command.strip()}`\nmachine: {machine()}\n")
    print(
        f"openai {openai.__version__} at its default max_retries (2), one client per thread; {args.clients} clients,"
        f" --max-inflight {args.max_inflight}, echo worker {args.max_tokens} tokens {args.token_delay_ms:g} ms apart,"
        f" sustained {args.seconds:g} s, warm-up {args.warmup} requests (not burst-cold); {args.rounds} rounds\n"
    )
    print(tables(rounds, scenarios))
    record(sitting, rounds, scenarios, args)
    sitting.write()


if __name__ == "__main__":
    main()
