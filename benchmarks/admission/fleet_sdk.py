"""Fleet shares keep appointments (issue 60, item 4): the openai SDK at its defaults in a burst on
one replica of two under a fleet in-flight cap, this tree against another in the same sitting.

Two governor replicas share `--fleet-max-inflight 8` through one Redis (each `--max-inflight 64`,
so only the fleet cap binds), each with its own echo worker (8 tokens 25 ms apart: a request holds
its slot about 0.2 s). After four warm-up requests on the first replica (the release forecast has
seen a service time) and the shares settled idle, 32 threads each with its own `openai.OpenAI`
(`max_retries` at its default, 2) are released together on the first replica, one completion
each. Every HTTP attempt is recorded by event hooks on the SDK's HTTP client: its status, the
refusing limit (the `reason` of the 429's body), `retry-after-ms` and `x-should-retry`. Both
replicas' stats are read every 10 ms: the fleet's in-flight requests (what reached the workers,
as benchmarks/admission/fleet.py measures them), against the cap.

Per run: the `fleet_*` refusals the SDK was told to come back to, how many of those returns came
on time (sent within half the default appointment grace, 25 ms, of the time told) and how many of
those were admitted (the target: >= 99%), the requests completed, and the peak in flight (the
target: never over 8). Rounds alternate the trees (`--before`: a checkout of the baseline, e.g.
`git worktree add /tmp/wt-fleet-before <commit>`, with a .venv beside it); a fresh fleet key per run.

    python -m benchmarks.admission.fleet_sdk --before /tmp/wt-fleet-before [--after TREE] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

import openai
import orjson

from benchmarks.harness.common import (
    ROOT,
    free_port,
    machine,
    markdown_table,
    out_dir,
    stats,
    stop,
    wait_for_port,
    wait_until,
)
from benchmarks.harness.fixtures.redis_server import RedisServer
from benchmarks.harness.results import Sitting
from benchmarks.harness.rounds import order

CAP, CLIENTS, TOKENS, TOKEN_DELAY_MS = 8, 32, 8, 25
ON_TIME_MS = 25.0  # half the default --appointment-grace-ms: a return inside its window
MODEL = "gpt2"  # the governor's default --served-model


@dataclass(slots=True)
class Attempt:
    """One HTTP attempt of an SDK call (perf_counter times)."""

    sent: float
    status: int = 0
    reason: str = ""
    hint_ms: float = 0.0
    retry: bool = False  # x-should-retry: true
    answered: float = 0.0


@dataclass(slots=True)
class Call:
    attempts: list[Attempt] = field(default_factory=list)
    error: str | None = None


class Hooks:
    """The attempts of a client thread's call, from its HTTP client's event hooks."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def on_request(self, request: Any) -> None:
        self.call.attempts.append(Attempt(time.perf_counter()))

    def on_response(self, response: Any) -> None:
        attempt = self.call.attempts[-1]
        attempt.answered = time.perf_counter()
        attempt.status = response.status_code
        headers = response.headers
        if response.status_code == 429:
            response.read()  # (an event hook sees the body only once read)
            attempt.reason = orjson.loads(response.content)["error"].get("reason", "")
        attempt.hint_ms = float(headers.get("retry-after-ms", 0))
        attempt.retry = headers.get("x-should-retry") == "true"


def start_replica(tree: Path, redis_url: str, key: str, name: str) -> tuple[Popen[bytes], int, int]:
    """A governor of `tree` (its own interpreter, its spawned echo worker), sharing the fleet cap:
    (process, NDJSON port, HTTP port), once its worker is up and its door listens."""
    port, http = free_port(), free_port()
    # Its fleet share books its refusals where the tree has the switch (`--fleet-promises on`, opt-in).
    config = (tree / "governor" / "shell" / "config.py").read_text()
    promises = ("--fleet-promises", "on") if "fleet_promises" in config else ()
    argv = [
        *("-m", "governor", "serve", "--port", str(port), "--metrics-port", "0", "--log-level", "warning"),
        *("--http-port", str(http), "--integrity", "optional", "--max-inflight", "64"),
        *("--fleet", redis_url, "--fleet-name", key, "--fleet-max-inflight", str(CAP), *promises),
        *("--", "--engine", "echo", "--token-delay-ms", str(TOKEN_DELAY_MS)),
    ]
    python = tree / ".venv" / "bin" / "python"
    with (out_dir() / f"fleet_sdk-{name}.log").open("ab") as log:
        proc = Popen([str(python if python.exists() else sys.executable), *argv], cwd=tree, stdout=log, stderr=log)
    try:
        wait_for_port(port)
        wait_until(lambda: stats(port)["workers"][0]["up"], 20)
        wait_for_port(http)
    except BaseException:
        stop(proc)
        raise
    return proc, port, http


def complete(http: int, prompt: str, barrier: threading.Barrier | None) -> Call:
    """One completion through the SDK at its defaults, its attempts recorded."""
    call = Call()
    hooks = Hooks(call)
    client = openai.DefaultHttpxClient(
        timeout=30.0, event_hooks={"request": [hooks.on_request], "response": [hooks.on_response]}
    )
    with openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", http_client=client) as sdk:
        assert sdk.max_retries == 2  # the SDK's default
        if barrier is not None:
            barrier.wait()
        try:
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS)
        except openai.APIError as exc:
            call.error = type(exc).__name__
    return call


class Sampler:
    """The fleet's in-flight requests, every 10 ms, from both replicas' stats."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with ThreadPoolExecutor(len(self.ports)) as pool:
            while not self._stop.is_set():
                self.samples.append(sum(s["inflight"] for s in pool.map(stats, self.ports)))
                time.sleep(0.01)

    def close(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.samples


def burst(tree: Path, redis: RedisServer, key: str, name: str) -> dict[str, Any]:
    """One run: two fresh replicas of `tree`, a burst of CLIENTS SDK calls on the first."""
    replicas = [start_replica(tree, redis.url, key, f"{name}-{i}") for i in range(2)]
    try:
        (_, first, http), (_, second, _) = replicas
        wait_until(lambda: all(stats(p)["fleet"]["replicas"] == 2 for p in (first, second)), 10)
        time.sleep(1.5)  # a new fleet grows no share for its first lease
        for i in range(4):
            warm = complete(http, f"warm-up {i} of {key}", None)
            if warm.error:
                raise RuntimeError(f"warm-up failed: {warm.error}")
        time.sleep(1.0)  # the shares settled idle
        sampler = Sampler([first, second])
        barrier = threading.Barrier(CLIENTS)
        with ThreadPoolExecutor(CLIENTS) as pool:
            calls = list(pool.map(lambda i: complete(http, f"{i} {key}: the quick brown fox", barrier), range(CLIENTS)))
        time.sleep(0.05)
        peak = max(sampler.close())
        outcomes = stats(first).get("retry_hints", {}).get("outcomes", {})
    finally:
        for proc, _, _ in replicas:
            stop(proc)
    return summarise(calls, peak, outcomes)


def summarise(calls: list[Call], peak: int, outcomes: dict[str, Any]) -> dict[str, Any]:
    """The run's figures from its calls' attempts."""
    returns = on_time = admitted = refusals = final = 0
    lateness: list[float] = []
    for call in calls:
        for told, back in zip(call.attempts, call.attempts[1:], strict=False):
            if told.status != 429 or not told.reason.startswith("fleet_"):
                continue
            returns += 1
            late_ms = (back.sent - told.answered) * 1000 - told.hint_ms
            lateness.append(late_ms)
            if late_ms <= ON_TIME_MS:
                on_time += 1
                admitted += back.status == 200
        for attempt in call.attempts:
            if attempt.status == 429 and attempt.reason.startswith("fleet_"):
                refusals += 1
                final += not attempt.retry
    completed = sum(call.error is None for call in calls)
    return {
        "fleet_refusals": refusals,
        "final_refusals": final,
        "returns": returns,
        "on_time_returns": on_time,
        "on_time_admitted": admitted,
        "on_time_admitted_share": admitted / on_time if on_time else 1.0,
        "completed": completed,
        "attempts_per_completed": sum(len(c.attempts) for c in calls) / max(1, completed),
        "lateness_p99_ms": statistics.quantiles(lateness, n=100)[98] if len(lateness) > 1 else 0.0,
        "peak_inflight": peak,
        "outcomes": {k: v for k, v in outcomes.items() if "fleet" in k} if isinstance(outcomes, dict) else {},
    }


def row(name: str, runs: list[dict[str, Any]]) -> list[str]:
    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    shares = ", ".join(f"{r['on_time_admitted_share']:.1%}" for r in runs)
    return [
        name,
        f"{med('fleet_refusals'):.0f} ({med('final_refusals'):.0f} final)",
        f"{med('on_time_returns'):.0f} of {med('returns'):.0f}",
        f"{med('on_time_admitted_share'):.1%} ({shares})",
        f"{med('completed'):.0f} of {CLIENTS}",
        f"{med('attempts_per_completed'):.2f}",
        f"{max(r['peak_inflight'] for r in runs)} ({', '.join(str(r['peak_inflight']) for r in runs)})",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the baseline tree (a checkout with a .venv)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the tree measured (default: this one)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two trees")
    args = parser.parse_args()
    sitting = Sitting(measures=("governor",))
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with RedisServer() as redis:
        for i in range(args.rounds):
            for name in order(i, list(trees)):
                result = burst(trees[name], redis, f"fleet-sdk-{i}-{name}-{time.monotonic_ns()}", name)
                runs[name].append(result)
                print(f"round {i + 1}, {name}: {result}", flush=True)
    print(f"\nmachine: {machine()}\n")
    print(f"2 replicas, fleet cap {CAP}, {CLIENTS} openai SDK clients (max_retries=2) at once on one:\n")
    headers = ["tree", "fleet refusals", "on-time returns", "admitted", "completed", "attempts/done", "peak"]
    print(markdown_table(headers, [row(name, r) for name, r in runs.items()]))
    share = {name: statistics.median(r["on_time_admitted_share"] for r in rs) for name, rs in runs.items()}
    peak = {name: max(r["peak_inflight"] for r in rs) for name, rs in runs.items()}
    sitting.figure(
        "on-time returns to a fleet_* refusal admitted, SDK burst of 32 on one of 2 replicas", 100 * share["after"],
        "%", baseline=(f"before ({args.before.name})", 100 * share["before"]), bar=">= 99%",
        met=share["after"] >= 0.99,
    )  # fmt: skip
    done = {name: statistics.median(r["completed"] for r in rs) for name, rs in runs.items()}
    final = {name: statistics.median(r["final_refusals"] for r in rs) for name, rs in runs.items()}
    sitting.figure(
        f"SDK calls completed of a burst of {CLIENTS} on one of 2 replicas (fleet cap {CAP})", done["after"],
        "calls", baseline=("before", done["before"]), headline=False,
    )  # fmt: skip
    sitting.figure(
        "fleet_* refusals final (x-should-retry: false), SDK burst", final["after"], "refusals",
        baseline=("before", final["before"]), headline=False,
    )  # fmt: skip
    sitting.figure(
        f"peak in flight under a fleet cap of {CAP}, SDK burst", peak["after"], "requests",
        baseline=("before", peak["before"]), bar=f"<= {CAP}", met=peak["after"] <= CAP, headline=False,
    )  # fmt: skip
    sitting.details = {"runs": runs, "before_tree": str(args.before), "after_tree": str(args.after)}
    sitting.write()


if __name__ == "__main__":
    main()
