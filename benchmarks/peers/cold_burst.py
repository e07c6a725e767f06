"""A cold governor in front of a fast serial server: what its first burst costs, beside the second
and third on the same governor and beside the server alone.

Every deploy, restart and scale-out starts a governor that has seen no stream of its endpoint. Its
forecast for a request not yet streaming then rests on a prior (100 ms a token before issue 60),
and the appointments it makes from that forecast bind: a server far faster than the prior idles
between the clients it sent to sleep (overload-sitting-3 §3: 21.6 s for a burst the server alone
serves in 1.3 s, at a 60 s horizon). This measures that, the issue's set-up:

- the server: benchmarks/harness/fixtures/serial_openai.py as a process of its own, one request
  at a time (`--server-slots`), the rest queued inside, `--tokens` tokens x `--token-ms` each,
  streamed with usage;
- the clients: `--clients` unmodified openai SDK clients (`openai.AsyncOpenAI(max_retries=20)`,
  one each, its own HTTP client with a hook that counts every attempt and its status), each
  sending one streamed `completions.create(max_tokens=--tokens)` per burst, all released at once;
  a 429's `retry-after-ms` is slept by the SDK before its retry, and a 429 with
  `x-should-retry: false` (past the promise horizon) raises at once: a request refused for good;
- per round and setting, a fresh governor (`--max-inflight 64 --worker http://.../v1,model=m,
  concurrency=K`, `--promise-horizon-ms H` or its default) takes `--bursts` bursts one after
  another, the same clients sending each; the server alone takes the same bursts, the same way.

Per burst: its wall time, from the release to the last completion; the ratio of the server alone's
wall time for the same burst of the same round to it (1.0: as fast as the server alone; the
issue's "0.06x"); the requests refused for good; the SDK's retries (attempts past each request's
first). Per fresh governor: the completions the server served that no client asked for (what
probing the endpoint cost it). Settings (each K of `--concurrency` at each horizon of
`--horizons`, and the server alone) take turns within each round, the first rotating; figures are
medians over rounds, ratios medians of per-round ratios. Issue 60's targets: the cold burst at a
60 s horizon >= 0.8x the server alone at K=1 and >= 0.9x at K=2; at the default horizon the cold
burst refuses no more than the third burst + 10% of the burst (the median of per-round
differences).

`--baseline-tree DIR` (a checkout of an earlier commit, e.g. a `git worktree`) runs every
governor setting from that tree too, in the same rounds, so that a change is measured against what
it replaced in one sitting (the governor there is `python -m governor` with DIR as its working
directory: DIR's packages come first on the path).

    python -m benchmarks.peers.cold_burst [--rounds 3] [--concurrency 1 2] [--horizons default 60000]
                                          [--baseline-tree /tmp/wt-cold-before]
    make bench-cold-burst
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
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
from benchmarks.harness.fixtures.serial_openai import Pace, SerialOpenAI
from benchmarks.harness.results import Sitting, baseline_tree
from benchmarks.harness.rounds import order
from benchmarks.peers.sdk_overload import MODEL, Request, governor_counts, on_response, one
from governor.shell.config import GovernorConfig

ALONE = "server alone"
DEFAULT = "default"
MAX_INFLIGHT = 64
SETTLE_S = 0.5  # between settings: the last one's connections closed, the server idle
TARGET_HORIZON_MS = 60_000.0  # the horizon the wall-time targets are for
COLD_RATIO_BAR = {1: 0.8, 2: 0.9}  # K -> the cold burst's least ratio to the server alone there
REFUSAL_SLACK = 0.10  # of the burst: what the cold burst may refuse beyond the third


@dataclass(frozen=True)
class Setting:
    """Where a burst goes: the server alone, or a governor from `tree` with K and a horizon."""

    tree: str = ""  # "" for this checkout, else the baseline's label
    k: int = 0  # 0: the server alone
    horizon: str = DEFAULT  # milliseconds, or "default"

    @property
    def name(self) -> str:
        if not self.k:
            return ALONE
        horizon = "default horizon" if self.horizon == DEFAULT else f"horizon {float(self.horizon) / 1000:g} s"
        return f"{self.tree + ': ' if self.tree else ''}K={self.k}, {horizon}"

    def horizon_ms(self) -> float:
        return GovernorConfig().promise_horizon_ms if self.horizon == DEFAULT else float(self.horizon)


@dataclass(frozen=True)
class Burst:
    """One burst's outcome: wall time from the release to the last completion (to the last raise
    where nothing completed), completions, refusals for good, the SDK's retries, 429s seen."""

    wall_s: float
    completed: int
    refused: int
    retries: int
    refusals_429: int
    failures: dict[str, int] = field(default_factory=dict)
    requests: tuple[Request, ...] = field(default=(), repr=False)  # for --json only

    def row(self) -> dict[str, Any]:
        """The burst for the result file: its counts, not its requests."""
        return {k: v for k, v in asdict(self).items() if k != "requests"}

    @classmethod
    def of(cls, requests: list[Request]) -> Burst:
        """`requests` timed from the burst's release (their `start` is ~0)."""
        done = [r.end for r in requests if r.ok]
        failures: dict[str, int] = {}
        for r in requests:
            if not r.ok:
                failures[r.error or "?"] = failures.get(r.error or "?", 0) + 1
        return cls(
            wall_s=max(done) if done else max((r.end for r in requests), default=0.0),
            completed=len(done),
            refused=len(requests) - len(done),
            retries=sum(max(0, len(r.statuses) - 1) for r in requests),
            refusals_429=sum(r.statuses.count(429) for r in requests),
            failures=failures,
            requests=tuple(requests),
        )


Round = dict[str, list[Burst]]  # setting name -> its bursts, in order


# -- the load ---------------------------------------------------------------------------------------


async def bursts(base_url: str, clients: int, count: int, tokens: int, label: str) -> list[Burst]:
    """`count` bursts one after another, each one request from each of `clients` SDK clients."""
    sdks = [
        openai.AsyncOpenAI(
            base_url=base_url,
            api_key="unused",
            max_retries=20,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]}),
        )
        for _ in range(clients)
    ]
    out = []
    try:
        for b in range(count):
            t0 = time.perf_counter()
            calls = (one(sdk, f"{label} burst {b + 1} client {i}: hello", tokens, t0) for i, sdk in enumerate(sdks))
            out.append(Burst.of(list(await asyncio.gather(*calls))))
    finally:
        for sdk in sdks:
            await sdk.close()
    return out


# -- the governors ----------------------------------------------------------------------------------


def start_governor(setting: Setting, server: SerialOpenAI, tree: Path) -> tuple[Popen[bytes], int, int]:
    """A fresh governor from `tree` in front of the server, once its endpoint is up: (process,
    NDJSON port, HTTP port)."""
    port, http = free_port(), free_port()
    worker = f"{server.base_url},model={MODEL},concurrency={setting.k}"
    argv = [sys.executable, "-m", "governor", "serve", "--port", str(port), "--http-port", str(http)]
    argv += ["--metrics-port", "0", "--log-level", "warning", "--integrity", "optional"]
    argv += ["--max-inflight", str(MAX_INFLIGHT), "--worker", worker]
    if setting.horizon != DEFAULT:
        argv += ["--promise-horizon-ms", setting.horizon]
    log = (out_dir() / f"cold_burst_{setting.tree or 'here'}_k{setting.k}.log").open("wb")
    proc = Popen(argv, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        wait_for_port(port)
        wait_for_port(http)
        wait_until(lambda: bool(stats(port)["workers"][0]["up"]), timeout=30)
    except BaseException:
        stop(proc)
        raise
    return proc, port, http


def run_setting(
    setting: Setting, server: SerialOpenAI, trees: dict[str, Path], args: argparse.Namespace
) -> tuple[list[Burst], int]:
    """One setting's bursts (a fresh governor's, or the server alone's), printed as they end, and
    the completions the server served that no client asked for (a governor's probes)."""
    before = server.get("/stats") or {}
    counts: dict[str, Any] = {}
    if not setting.k:
        result = asyncio.run(bursts(server.base_url, args.clients, args.bursts, args.tokens, setting.name))
    else:
        proc, port, http = start_governor(setting, server, trees[setting.tree])
        try:
            first = stats(port)
            url = f"http://127.0.0.1:{http}/v1"
            result = asyncio.run(bursts(url, args.clients, args.bursts, args.tokens, setting.name))
            counts = governor_counts(first, stats(port))
        finally:
            stop(proc)
    served = (server.get("/stats") or {}).get("completions", 0) - before.get("completions", 0)
    for i, b in enumerate(result):
        print(
            f"  {setting.name} burst {i + 1}: {b.wall_s:.2f} s, {b.completed} completed, {b.refused} refused"
            f" {b.failures or ''}, {b.retries} retries ({b.refusals_429} 429s)",
            flush=True,
        )
    unasked = served - sum(b.completed for b in result)
    print(f"  {setting.name}: the server served {served} completions, {unasked} that no client asked for; {counts}")
    time.sleep(SETTLE_S)
    return result, unasked


# -- figures ----------------------------------------------------------------------------------------


def ratios(rounds: list[Round], name: str, burst: int) -> list[float]:
    """Per round: the server alone's wall time for burst `burst` over this setting's."""
    return [r[ALONE][burst].wall_s / r[name][burst].wall_s for r in rounds]


def med(rounds: list[Round], name: str, burst: int, pick: Callable[[Burst], float]) -> float:
    return statistics.median(pick(r[name][burst]) for r in rounds)


def refusal_excess(rounds: list[Round], name: str) -> float:
    """The median over rounds of (cold burst's refusals - third's): the issue's refusal target."""
    return statistics.median(r[name][0].refused - r[name][min(2, len(r[name]) - 1)].refused for r in rounds)


def settings_of(args: argparse.Namespace, baseline: str | None) -> list[Setting]:
    trees = ["", *([baseline] if baseline else [])]
    governed = [Setting(t, k, h) for t in trees for k in args.concurrency for h in args.horizons]
    return [Setting(), *governed]


def record(
    sitting: Sitting, rounds: list[Round], settings: list[Setting], unasked: dict[str, list[int]], clients: int
) -> None:
    """Per governor setting: the cold burst's ratio to the server alone (with the issue's bar at
    the 60 s horizon, for this checkout; a headline past the default horizon, where every request
    is served) and its refusals beside the third burst's (with the bar at the default horizon);
    the later bursts' ratios and what the governor asked of the server itself (its probes) as
    details; the baseline tree's figures beside them, without bars."""
    alone = med(rounds, ALONE, 0, lambda b: b.wall_s)
    slack = REFUSAL_SLACK * clients
    # this checkout's first, the 60 s horizon's before the default's: the first headline is the page's row
    for s in sorted(settings[1:], key=lambda s: (bool(s.tree), s.horizon == DEFAULT, s.k)):
        mine = not s.tree
        cold = statistics.median(ratios(rounds, s.name, 0))
        bar = COLD_RATIO_BAR.get(s.k) if mine and s.horizon_ms() == TARGET_HORIZON_MS else None
        sitting.figure(
            f"cold burst, wall time as a share of the server alone's, {s.name}",
            med(rounds, s.name, 0, lambda b: b.wall_s),
            "s",
            baseline=("the server alone", alone),
            ratio=cold,
            bar=None if bar is None else f"ratio >= {bar}",
            met=None if bar is None else cold >= bar,
            headline=mine and s.horizon != DEFAULT,
            note="ratio: the server alone's wall time over this one's, median of per-round ratios"
            + (
                ""
                if s.horizon != DEFAULT
                else "; at the default horizon a burst refuses some for good: it serves fewer"
            ),
        )
        excess = refusal_excess(rounds, s.name)
        held = mine and s.horizon == DEFAULT
        sitting.figure(
            f"cold burst, requests refused for good, {s.name}",
            med(rounds, s.name, 0, lambda b: b.refused),
            "requests",
            baseline=(
                "the third burst on the same governor",
                med(rounds, s.name, len(rounds[0][s.name]) - 1, lambda b: b.refused),
            ),
            difference=excess,
            bar=f"<= the third burst + {slack:g}" if held else None,
            met=excess <= slack if held else None,
            headline=held,
            note="difference: median of per-round (cold - third)",
        )
        for b in range(1, len(rounds[0][s.name])):
            sitting.figure(
                f"burst {b + 1}, wall time as a share of the server alone's, {s.name}",
                med(rounds, s.name, b, lambda x: x.wall_s),
                "s",
                baseline=("the server alone", med(rounds, ALONE, b, lambda x: x.wall_s)),
                ratio=statistics.median(ratios(rounds, s.name, b)),
                headline=False,
            )
        sitting.figure(
            f"completions no client asked for (the governor's probes), per fresh governor, {s.name}",
            statistics.median(unasked[s.name]),
            "completions",
            headline=False,
            note="what the server served beyond the bursts' completions, median over rounds",
        )
    sitting.details = {
        "settings": [asdict(s) | {"name": s.name} for s in settings],
        "rounds": [{name: [b.row() for b in bs] for name, bs in r.items()} for r in rounds],
    }


def table(rounds: list[Round], settings: list[Setting]) -> str:
    """Medians over rounds, one row per setting: per burst its wall time (its ratio to the server
    alone), refusals for good and retries."""
    count = len(rounds[0][ALONE])
    rows = []
    for s in settings:
        cells = [s.name]
        for b in range(count):
            ratio = "" if not s.k else f" ({statistics.median(ratios(rounds, s.name, b)):.2f}x)"
            cells.append(
                f"{med(rounds, s.name, b, lambda x: x.wall_s):.2f} s{ratio},"
                f" {med(rounds, s.name, b, lambda x: x.refused):g} refused,"
                f" {med(rounds, s.name, b, lambda x: x.retries):g} retries"
            )
        rows.append(cells)
    headers = ["setting", *(f"burst {b + 1}{' (cold)' if b == 0 else ''}" for b in range(count))]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=48, help="SDK clients, one request each per burst")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per setting, one after another")
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of each request")
    parser.add_argument("--token-ms", type=float, default=3.0, help="the server's time per token")
    parser.add_argument("--server-slots", type=int, default=1, help="requests the server generates at once")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2], help="the endpoint's K to try")
    parser.add_argument("--horizons", nargs="+", default=[DEFAULT, "60000"], help="ms, or 'default'")
    parser.add_argument("--baseline-tree", help="a checkout whose governor runs beside this one's")
    parser.add_argument("--json", type=Path, help="per-request records (default benchmarks/out/cold_burst.json)")
    args = parser.parse_args()
    # `timeout` and a stopped job send SIGTERM: exit through the finally clauses that stop the governor
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    baseline = baseline_tree(args.baseline_tree)
    trees = {"": ROOT, **({baseline[0]: baseline[1]} if baseline else {})}
    settings = settings_of(args, baseline[0] if baseline else None)
    sitting = Sitting(("govwire", "governor"))
    rounds: list[Round] = []
    unasked: dict[str, list[int]] = {s.name: [] for s in settings}
    with SerialOpenAI(Pace(args.token_ms / 1000, args.server_slots, MODEL)) as server:
        asyncio.run(bursts(server.base_url, 4, 1, args.tokens, "warm-up"))  # imports, first connections
        for i in range(args.rounds):
            print(f"round {i + 1}", flush=True)
            this: Round = {}
            for s in order(i, settings, rotate=True):
                this[s.name], probes = run_setting(s, server, trees, args)
                unasked[s.name].append(probes)
            rounds.append(this)
    print(f"\ncommand: `{sitting.command}`\nmachine: {machine()}")
    if baseline:
        print(f"baseline tree: {baseline[1]} ({baseline[0]})")
    print(
        f"\nthe serial server ({args.server_slots} at a time, {args.tokens} tokens x {args.token_ms:g} ms),"
        f" {args.clients} openai SDK clients (max_retries=20), {args.bursts} bursts per fresh governor"
        f" (--max-inflight {MAX_INFLIGHT}); medians of {args.rounds} rounds, ratios: the server alone's"
        " wall time over the setting's, median of per-round ratios\n"
    )
    print(table(rounds, settings))
    record(sitting, rounds, settings, unasked, args.clients)
    raw = args.json or out_dir() / "cold_burst.json"
    requests = [{n: [[asdict(q) for q in b.requests] for b in bs] for n, bs in r.items()} for r in rounds]
    raw.write_bytes(orjson.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": requests}))
    print(f"per-request records: {raw}")
    sitting.write()


if __name__ == "__main__":
    main()
