"""What a computed, kept retry hint is worth against what other software tells a refused client:
the llama-server sitting of benchmarks/peers/sdk_overload.py (its set-up, imported), with the
governor's hint swapped for each rival rule, in the same sitting.

Gateways send a fixed Retry-After or none; llm-d is designing one from its drain rate; the
governor computes when the capacity a refused client needs frees, books it, and keeps it (or, past
its promise horizon, says no for good). Nobody publishes how such hints compare with the clients
people run. So, per policy, with the unmodified openai SDK (`max_retries=2`, its own HTTP client):

- `server alone`: straight at llama-server, which queues everything;
- `ours`: the governor as it is (`--max-inflight P`, its default promise horizon);
- `ours, 10 s horizon`: the same with `--promise-horizon-ms 10000` (`--horizon-ms`);
- `ours, no proxy`: ours straight at the front door, what the proxy's hop costs ours (a return
  is recognised in a window of +-25 ms, `--appointment-grace-ms`; a rival's rule has no window);
- `constant 1 s`: a constant 1 s hint that the client does retry at (`retry-after-ms: 1000`,
  `x-should-retry: true`);
- `llm-d rule`: llm-d's proposed Retry-After (llm-d-router#2487, as its PR #2489 implements it):
  1 / an EWMA of dispatches/s (weight 0.3, folded once a second, raised to the current window's
  rate), in whole seconds rounded up, capped at 30 s, omitted under 1 s and before any dispatch;
- `no hint`: no retry header (the SDK's own backoff: 0.5 s then 1 s, each less up to 25%);
- `refuse at once`: `x-should-retry: false`, a final answer.

The rival rules are rules for a 429's headers, so they live in the benchmark: a thin proxy
(benchmarks/harness/hint_proxy.py, aiohttp) in front of the governor's front door rewrites each
429's retry headers and relays everything else as it came; `ours` goes through the same proxy
untouched, so every policy pays the same hop. Behind a rival the governor runs `--retry-hint
fixed`: a plain concurrency cap at P that books nothing and keeps no capacity for anybody (its
own 50 ms hints, rewritten by the proxy, are never final), which is what a gateway with any of
these rules is. The rivals have no promise horizon, so their runs count at both SLOs below.

Per round, each policy in turn (the order rotated each round): a fresh governor and proxy, then
1. burst cold: `--burst` requests at once at the fresh governor;
2. burst warm: the same burst again, at the governor that served the cold one;
3. poisson: open-loop Poisson arrivals at `--overload` x capacity for `--seconds` (seeded by the
   round: the same arrivals for every policy), at that governor still.
`server alone` gets the same loads at llama-server as it is. Capacity is measured first, as
sdk_overload does (a closed loop of P SDK clients straight at llama-server).

Every policy is sent the same requests in a round (the same arrivals), so the comparison is how
many of them got their first token within the SLO (from the first attempt: a client told to come
back pays for the wait), at `--slo-ms` and with the SLO set to the 10 s horizon: a burst's count,
and for Poisson that count per second of arrivals (goodput). Not per second of the run's window,
as sdk_overload counts it: a window ends at the last reply, so a policy whose failures come later
(a client that retried) would pay for its tail. Also per run: completed; on-time returns admitted
= the retries sent at or after the wait their 429 named (as the SDK read it) that were admitted (a
200), over such retries (none for `no hint` or a refusal at once: they name no wait); returns
admitted after a 429 that named no wait; retries per completed request; how long the failures
(the SDK raised) took from the first attempt (p50 / p99); and for the governor its own count of
returns to its appointments by outcome (`stats.retry_hints`). sdk_overload's bars are checked for
ours at the default horizon without the proxy (as sdk_overload runs it), with sdk_overload's own
goodput (per second of the window). Figures are medians over rounds. Per-request records go to
benchmarks/out/hint_policies.json.

    python -m benchmarks.peers.hint_policies [--rounds 3] [--seconds 20] [--burst 32] [--overload 2.5]
                                             [--slo-ms 2000] [--horizon-ms 10000] [--parallel 8]
    make bench-hint-policies
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Any

import openai
import orjson

from benchmarks.harness import rounds as alternating
from benchmarks.harness.common import machine, markdown_table, out_dir, random_text, stats, stop
from benchmarks.harness.hint_proxy import CONSTANT, FINAL, LLMD, NONE, OURS, start_hint_proxy
from benchmarks.harness.results import ROOT, Sitting
from benchmarks.peers import llamacpp
from benchmarks.peers.sdk_overload import (
    LOADS,
    POISSON,
    SETTLE_S,
    LlamaSitting,
    Request,
    Run,
    add_sitting_arguments,
    arrivals_of,
    drive,
    fmt_ms,
    governor_counts,
    llama_sitting,
    start_governor,
)

SERVER, OURS_NAME, NO_PROXY = "server alone", "ours", "ours, no proxy"
FIXED = "--retry-hint fixed"  # behind a rival: a plain cap, nothing booked, nothing kept
EARLY_S = 0.001  # a retry this much before its named wait is still on time (the clocks' grain)


@dataclass(frozen=True)
class Policy:
    name: str
    rule: str | None  # the proxy's rule (hint_proxy.POLICIES); None: no proxy
    governor_args: str | None = FIXED  # the governor's flags; None: no governor, llama-server alone

    @property
    def ours(self) -> bool:
        """The governor's own hint (through the proxy or not), not a rival's."""
        return self.governor_args is not None and self.rule in (None, OURS)


def policies(horizon_ms: float) -> tuple[Policy, ...]:
    return (
        Policy(SERVER, None, None),
        Policy(OURS_NAME, OURS, ""),
        Policy(horizon_name(horizon_ms), OURS, f"--promise-horizon-ms {horizon_ms:g}"),
        Policy(NO_PROXY, None, ""),  # what the proxy's hop costs ours (its appointments' windows are narrow)
        Policy("constant 1 s", CONSTANT),
        Policy("llm-d rule", LLMD),
        Policy("no hint", NONE),
        Policy("refuse at once", FINAL),
    )


def horizon_name(horizon_ms: float) -> str:
    return f"ours, {horizon_ms / 1000:g} s horizon"


# -- what became of the retries ---------------------------------------------------------------------


@dataclass(frozen=True)
class Returns:
    """Every retry of a run: after a 429 that named a wait (and whether it came at or after it),
    or one that named none; and how many of each were admitted."""

    on_time: int = 0
    on_time_admitted: int = 0
    early: int = 0
    unnamed: int = 0
    unnamed_admitted: int = 0

    @property
    def on_time_share(self) -> float | None:
        return self.on_time_admitted / self.on_time if self.on_time else None

    @property
    def unnamed_share(self) -> float | None:
        return self.unnamed_admitted / self.unnamed if self.unnamed else None


def returns_of(requests: Sequence[Request]) -> Returns:
    """Count each retry by the 429 before it. An attempt's send, response head and status line up
    by index; a request where they do not (an attempt that got no response) is left out."""
    on_time = on_time_admitted = early = unnamed = unnamed_admitted = 0
    for r in requests:
        if not len(r.sent) == len(r.answered) == len(r.statuses) or r.statuses.count(429) != len(r.hints_ms):
            continue
        hints = iter(r.hints_ms)
        for k in range(1, len(r.statuses)):
            if r.statuses[k - 1] != 429:
                continue
            wait_ms, admitted = next(hints), r.statuses[k] == 200
            if wait_ms != wait_ms:  # NaN: no wait named
                unnamed, unnamed_admitted = unnamed + 1, unnamed_admitted + admitted
            elif r.sent[k] - r.answered[k - 1] >= wait_ms / 1000 - EARLY_S:
                on_time, on_time_admitted = on_time + 1, on_time_admitted + admitted
            else:
                early += 1
    return Returns(on_time, on_time_admitted, early, unnamed, unnamed_admitted)


def within(run: Run, slo_s: float) -> int:
    """Completed requests with TTFT (from the first attempt) <= `slo_s`."""
    return sum(1 for r in run.done if r.ttft is not None and r.ttft <= slo_s)


def retries_per_success(run: Run) -> float | None:
    return (run.attempts - run.sent) / run.completed if run.completed else None


def outcomes(counts: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The governor's returns to its appointments by outcome (`governor_counts`' "returns", keyed
    "reason outcome"), summed over reasons and over the runs given."""
    found: dict[str, int] = {}
    for run_counts in counts:
        for key, n in (run_counts.get("returns") or {}).items():
            outcome = key.rpartition(" ")[2]
            found[outcome] = found.get(outcome, 0) + n
    return found


def kept_by_governor(counts: dict[str, Any]) -> float | None:
    """The governor's own count: returns in their window admitted (`on_time`) over returns in their
    window (`on_time`, `yielded_again`, `refused_elsewhere`)."""
    found = outcomes([counts])
    came = sum(found.get(k, 0) for k in ("on_time", "yielded_again", "refused_elsewhere"))
    return found.get("on_time", 0) / came if came else None


def summary(run: Run, horizon_s: float) -> dict[str, Any]:
    back = returns_of(run.requests)
    return {
        **run.summary(),
        "within_horizon": within(run, horizon_s),
        "returns": asdict(back),
        "on_time_returns_admitted": back.on_time_share,
        "unnamed_returns_admitted": back.unnamed_share,
        "retries_per_success": retries_per_success(run),
        "governor_kept": kept_by_governor(run.governor),
    }


# -- the sitting ------------------------------------------------------------------------------------

Rounds = dict[str, list[dict[str, Run]]]  # load -> one {policy: run} per round


def policy_runs(llama: LlamaSitting, policy: Policy, round_: int, args: argparse.Namespace) -> dict[str, Run]:
    """Every load at one policy: a fresh governor and proxy (none for the server alone)."""
    started = []
    try:
        port = None
        url = llama.url
        if policy.governor_args is not None:
            governor, port, http_port = start_governor(llama.port, args.parallel, policy.governor_args)
            started.append(governor)
            url = f"http://127.0.0.1:{http_port}/v1"
        if policy.rule is not None and port is not None:
            proxy, proxy_port = start_hint_proxy(http_port, policy.rule, out_dir() / "hint_policies_proxy.log")
            started.append(proxy)
            url = f"http://127.0.0.1:{proxy_port}/v1"
        runs = {}
        for load in LOADS:
            arrivals = arrivals_of(load, round_ + 1, args.overload * llama.capacity, args)
            rng = random.Random(f"{round_ + 1} {load} {policy.name}")  # distinct prompts: no cache hits
            prompts = [random_text(rng, 64) for _ in arrivals]
            before = stats(port) if port is not None else {}
            requests = asyncio.run(drive(url, arrivals, prompts, args.max_tokens))
            counts = governor_counts(before, stats(port)) if port is not None else {}
            runs[load] = Run(load, policy.name, requests, args.slo_ms / 1000, counts)
            print(f"round {round_ + 1} {policy.name:>20} {runs[load].line()}", flush=True)
            time.sleep(SETTLE_S)
        return runs
    finally:
        for proc in reversed(started):
            stop(proc)


def sitting_rounds(llama: LlamaSitting, args: argparse.Namespace) -> Rounds:
    results: Rounds = {load: [] for load in LOADS}
    every = [p for p in policies(args.horizon_ms) if not args.only or p.name in args.only]
    for r in range(args.rounds):
        by_policy = {p.name: policy_runs(llama, p, r, args) for p in alternating.order(r, every, rotate=True)}
        for load in LOADS:
            results[load].append({p.name: by_policy[p.name][load] for p in every})
    return results


# -- tables, figures --------------------------------------------------------------------------------


def med(rs: list[dict[str, Run]], policy: str, pick: Callable[[Run], float | None]) -> float | None:
    return alternating.median(rs, policy, pick)


def share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def pooled(rs: list[dict[str, Run]], policy: str) -> Returns:
    """A policy's returns summed over rounds (a share of few returns per round is noisy)."""
    each = [returns_of(rnd[policy].requests) for rnd in rs]
    return Returns(*(sum(getattr(b, f.name) for b in each) for f in fields(Returns)))


def good(rs: list[dict[str, Run]], policy: str, slo_s: float, load: str, args: argparse.Namespace) -> float:
    """The median over rounds of a policy's requests within `slo_s`: a burst's count, or for Poisson
    that count per second of arrivals."""
    count = med(rs, policy, partial(within, slo_s=slo_s)) or 0.0
    return count / args.seconds if load == POISSON else count


def good_cell(rs: list[dict[str, Run]], policy: str, slo_s: float, load: str, args: argparse.Namespace) -> str:
    count = med(rs, policy, partial(within, slo_s=slo_s)) or 0.0
    rate = f" ({good(rs, policy, slo_s, load, args):.2f}/s)" if load == POISSON else ""
    return f"{count:g}{rate}"


def table(load: str, rs: list[dict[str, Run]], args: argparse.Namespace) -> str:
    slo_s, horizon_s = args.slo_ms / 1000, args.horizon_ms / 1000
    headers = [
        "policy",
        "completed",
        f"TTFT ≤ {slo_s:g} s",
        f"TTFT ≤ {horizon_s:g} s",
        "on-time returns admitted (of)",
        "unnamed returns admitted (of)",
        "retries / success",
        "failed (after p50 / p99 ms)",
        "TTFT p50 / p99 (ms)",
        "the governor's count of returns",
    ]
    rows = []
    for policy in rs[0]:
        back = pooled(rs, policy)

        def m(pick: Callable[[Run], float | None], p: str = policy) -> float | None:
            return med(rs, p, pick)

        rows.append(
            [
                policy,
                f"{fmt_ms(m(lambda r: r.completed))}/{fmt_ms(m(lambda r: r.sent))}",
                good_cell(rs, policy, slo_s, load, args),
                good_cell(rs, policy, horizon_s, load, args),
                f"{share(back.on_time_share)} ({back.on_time})",
                f"{share(back.unnamed_share)} ({back.unnamed})",
                f"{m(retries_per_success) or 0:.2f}",
                f"{fmt_ms(m(lambda r: len(r.failed)))} ({fmt_ms(m(lambda r: r.failed_after_ms(50)))} /"
                f" {fmt_ms(m(lambda r: r.failed_after_ms(99)))})",
                f"{fmt_ms(m(lambda r: r.ttft_ms(50)))} / {fmt_ms(m(lambda r: r.ttft_ms(99)))}",
                ", ".join(f"{k} {n}" for k, n in sorted(outcomes(rnd[policy].governor for rnd in rs).items())),
            ]
        )
    return f"{load} (medians over {len(rs)} rounds; returns summed over them):\n\n{markdown_table(headers, rows)}"


def record(sitting: Sitting, results: Rounds, capacity: float, args: argparse.Namespace) -> None:
    """Per load and horizon, ours against the best rival (the most requests within that horizon's
    SLO, the server alone included), held to >= every rival (and so ours without the proxy, at the
    default horizon); at the long horizon ours keeps >= 99% of its promises; and sdk_overload's
    bars (`no_regression`)."""
    long_name = horizon_name(args.horizon_ms)
    settings = (
        ("the default horizon", OURS_NAME, args.slo_ms / 1000),
        (f"a {args.horizon_ms / 1000:g} s horizon", long_name, args.horizon_ms / 1000),
        ("the default horizon without the proxy", NO_PROXY, args.slo_ms / 1000),
    )
    rival = {p.name for p in policies(args.horizon_ms) if not p.ours}
    sitting.figure(f"capacity: llama-server, closed loop of {args.parallel} SDK clients", capacity, "req/s")
    for load in LOADS:
        rs = results[load]
        poisson = load == POISSON
        name = f"Poisson at {args.overload:g}x capacity" if poisson else f"{load} of {args.burst}"
        for setting, ours, slo_s in settings:
            value = {p: good(rs, p, slo_s, load, args) for p in rs[0]}
            rivals = {p: v for p, v in value.items() if p in rival}
            best = max(rivals, key=lambda p: rivals[p])
            what = "goodput" if poisson else "requests served"
            sitting.figure(
                f"{what} (TTFT <= {slo_s:g} s), {name}, ours at {setting} against the best rival",
                value[ours],
                "req/s" if poisson else "requests",
                baseline=(best, rivals[best]),
                bar=">= every rival",
                met=value[ours] >= rivals[best],
                headline=poisson,
            )
            back = pooled(rs, ours)
            long = ours == long_name
            sitting.figure(
                f"on-time returns admitted, {name}, ours at {setting}",
                None if back.on_time_share is None else 100 * back.on_time_share,
                "%",
                bar=">= 99%" if long else None,
                met=None if back.on_time_share is None or not long else back.on_time_share >= 0.99,
                headline=long and poisson,
                note=f"{back.on_time_admitted} of {back.on_time} returns over {len(rs)} rounds",
            )
    no_regression(sitting, results[POISSON], capacity, args)


def no_regression(sitting: Sitting, rs: list[dict[str, Run]], capacity: float, args: argparse.Namespace) -> None:
    """sdk_overload's bars, for ours at the default horizon under the Poisson overload, without the
    proxy (as sdk_overload runs it)."""
    value = med(rs, NO_PROXY, lambda r: r.goodput)
    ratio = None if value is None or not capacity else value / capacity
    sitting.figure(
        f"goodput (TTFT <= {args.slo_ms / 1000:g} s, per second of the window) of ours without the proxy ÷ capacity,"
        f" Poisson at {args.overload:g}x capacity",
        value,
        "req/s",
        baseline=("capacity (closed loop, direct)", capacity),
        ratio=ratio,
        bar=">= 0.8x",
        met=None if ratio is None else ratio >= 0.8,
    )
    after = med(rs, NO_PROXY, lambda r: r.failed_after_ms(50))
    sitting.figure(
        f"failed requests: raised after (p50, from the first attempt), ours without the proxy, Poisson at"
        f" {args.overload:g}x capacity",
        after,
        "ms",
        bar="<= 100 ms",
        met=None if after is None else after <= 100.0,
    )


def write_raw(results: Rounds, args: argparse.Namespace, capacity: float) -> str:
    """Every request of every run to benchmarks/out/hint_policies.json; its path, for the details."""
    raw = out_dir() / "hint_policies.json"
    per_round = [
        {load: {p: [asdict(q) for q in run.requests] for p, run in results[load][i].items()} for load in LOADS}
        for i in range(args.rounds)
    ]
    document = {"args": vars(args), "capacity_per_s": capacity, "rounds": per_round}
    raw.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return str(raw.relative_to(ROOT))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sitting_arguments(parser)
    parser.add_argument("--slo-ms", type=float, default=2000.0, help="the TTFT goodput counts at the default horizon")
    parser.add_argument("--horizon-ms", type=float, default=10000.0, help="ours' long promise horizon, and its SLO")
    parser.add_argument(
        "--only",
        type=lambda text: [name.strip() for name in text.split(";")],
        default=[],
        help="these policies alone, by name ('ours; no hint'): a trial, that writes no result file",
    )
    args = parser.parse_args()
    unknown = set(args.only) - {p.name for p in policies(args.horizon_ms)}
    if unknown:
        parser.error(f"--only: no policy {', '.join(sorted(unknown))}")
    return args


def details(results: Rounds, args: argparse.Namespace, capacity: float, raw: str) -> dict[str, Any]:
    """The result's details: what the figures page's picture reads, and every run's summary."""
    horizon_s = args.horizon_ms / 1000
    return {
        "openai": openai.__version__,
        "llama_cpp": llamacpp.SDIST,
        "capacity_per_s": capacity,
        "poisson_rate_per_s": args.overload * capacity,
        "slo_ms": args.slo_ms,
        "horizon_ms": args.horizon_ms,
        "policies": {p.name: {"rule": p.rule, "governor_args": p.governor_args} for p in policies(args.horizon_ms)},
        "raw": raw,
        "rounds": [
            {load: {p: summary(run, horizon_s) for p, run in results[load][i].items()} for load in LOADS}
            for i in range(args.rounds)
        ],
    }


def main() -> None:
    args = parse_args()
    sitting = Sitting(("govwire", "governor"))
    with llama_sitting(args) as llama:
        if llama is None:
            return
        capacity = llama.capacity
        results = sitting_rounds(llama, args)
    print(
        f"\nmachine: {machine()}\nllama-server (llama.cpp from {llamacpp.SDIST}) GPT-2 small f32, --parallel"
        f" {args.parallel}; the governor --max-inflight {args.parallel} behind the hint proxy; openai"
        f" {openai.__version__} at its defaults; {args.max_tokens} tokens per request; capacity {capacity:.2f}"
        f" req/s; bursts of {args.burst}; Poisson at {args.overload:g}x capacity for {args.seconds:g} s;"
        f" {args.rounds} round(s)\n"
    )
    print("\n\n".join(table(load, results[load], args) for load in LOADS))
    raw = write_raw(results, args, capacity)
    if args.only:
        print("a trial of some policies: no result file written")
        return
    record(sitting, results, capacity, args)
    sitting.details = details(results, args, capacity, raw)
    sitting.write()


if __name__ == "__main__":
    main()
