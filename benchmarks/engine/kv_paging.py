"""Experiment 7: the paged KV cache, through the governor, side by side in one run.

    python -m benchmarks.engine.kv_paging [--experiments prefix,overask,pressure] [--model random-gpt2]

Each configuration is a `governor serve` with its spawned GPT-2 worker (no cap at the governor:
what differs is the worker), started in turn in one run; every request is sent at once over TCP
by the asyncio client, greedy, end-of-sequence ignored. The random models' tokenizer is bytes, so
a prompt of n ASCII characters is n tokens.

- prefix:   64 requests sharing a 512-token system prompt, each with 16-64 tokens of its own, 32
            new tokens: prefix caching on against --no-prefix-caching. TTFT (client: all sent ->
            first token) p50/p99, generated tokens/s, the worker's prefix-cache hits.
- overask:  96 requests asking for 512 new tokens whose clients stop reading (and cancel) after
            16-64, at --kv-cache-tokens 8192: --kv-reservation paged against worst-case. Running
            sequences per engine step (the worker's step_sequences / steps) and useful tokens/s.
- pressure: 48 requests of 96 new tokens against a KV pool smaller than they need together,
            against a pool large enough: preemptions, every request finishing, greedy outputs
            equal, tokens/s per generated token.
Greedy outputs of the two configurations of each experiment are compared request by request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.common import machine, markdown_table, out_dir, random_text, start_governor, stats, stop
from benchmarks.harness.results import Sitting
from governor.bench.stats import percentile
from governor.client import AsyncClient


@dataclass(frozen=True)
class Request:
    prompt: str
    max_new_tokens: int
    read: int  # tokens the client reads before it stops (cancels); = max_new_tokens: all


@dataclass(frozen=True)
class Outcome:
    ttft_s: float
    end_s: float
    tokens: list[int]
    cached_prompt_tokens: int | None


@dataclass
class Run:
    name: str
    outcomes: list[Outcome]
    wall_s: float
    engine: dict[str, float]  # the worker's statistics over the measured run (counters as deltas)

    @property
    def tokens(self) -> int:
        return sum(len(o.tokens) for o in self.outcomes)

    def ttft_ms(self, q: float) -> float:
        """The q-quantile (0-1) of the TTFT, ms, interpolated (every run has outcomes)."""
        value = percentile([o.ttft_s for o in self.outcomes], 100 * q)
        assert value is not None, "a run without outcomes"
        return 1000 * value

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def sequences_per_step(self) -> float:
        return self.engine["step_sequences_total"] / max(self.engine["steps_total"], 1)


async def send_all(port: int, requests: list[Request]) -> tuple[list[Outcome], float]:
    async with AsyncClient(port=port, timeout=900) as client:
        await client.connect()
        started = time.perf_counter()

        async def one(request: Request) -> Outcome:
            first: float | None = None
            tokens: list[int] = []
            stream = client.stream(
                request.prompt, max_new_tokens=request.max_new_tokens, temperature=0.0, stop_on_eos=False
            )
            async with stream:
                async for token in stream:
                    first = first or time.perf_counter()
                    tokens.append(token.token_id)
                    if len(tokens) == request.read:
                        break
            now = time.perf_counter()
            cached = stream.result.reply.get("cached_prompt_tokens") if stream.result else None
            return Outcome((first or now) - started, now - started, tokens, cached)

        outcomes = await asyncio.gather(*(one(r) for r in requests))
        return list(outcomes), max(o.end_s for o in outcomes)


def engine_stats(port: int) -> dict[str, float]:
    return dict(stats(port)["workers"][0]["engine"])


def measure(name: str, worker: list[str], requests: list[Request], warmup: list[Request], args: Any) -> Run:
    flags = ["--engine", "gpt2", "--model", args.model, "--threads", str(args.threads), "--dtype", args.dtype]
    proc, port = start_governor(
        "--max-inflight",
        "100000",
        worker_args=(*flags, "--stats-interval-s", "0.1", *worker),
        log=out_dir() / f"kv_paging_{name}.log",
        timeout=300,
    )
    try:
        asyncio.run(send_all(port, warmup))
        time.sleep(0.3)
        before = engine_stats(port)
        outcomes, wall = asyncio.run(send_all(port, requests))
        time.sleep(0.5)  # the last cancels reach the worker; one more stats push
        after = engine_stats(port)
    finally:
        stop(proc)
    engine = {k: after[k] - before.get(k, 0) if k.endswith("_total") else after[k] for k in after}
    run = Run(name, outcomes, wall, engine)
    hits, queries = engine.get("prefix_cache_hits_tokens_total", 0), engine.get("prefix_cache_queries_tokens_total", 0)
    print(
        f"  {name}: {run.tokens} tokens in {wall:.2f} s = {run.tokens_per_s:.1f} tok/s; TTFT p50 "
        f"{run.ttft_ms(0.5):.0f} ms p99 {run.ttft_ms(0.99):.0f} ms; {run.sequences_per_step:.1f} sequences/step; "
        f"preemptions {engine.get('preemptions_total', 0):.0f}; prefix hits {hits:.0f}/{queries:.0f}",
        flush=True,
    )
    return run


def same_outputs(a: Run, b: Run) -> str:
    """Greedy tokens of each request, compared over what both runs produced for it."""
    equal = sum(
        x.tokens[: min(len(x.tokens), len(y.tokens))] == y.tokens[: min(len(x.tokens), len(y.tokens))]
        for x, y in zip(a.outcomes, b.outcomes, strict=True)
    )
    return f"{equal}/{len(a.outcomes)}"


# The bars of docs/benchmarks/sittings.md, section 7: prefix caching cuts TTFT p50 >= 3x and raises tokens/s
# >= 1.5x; paged reservation runs >= 3x the sequences per step and >= 2x the tokens/s of worst-case;
# a pool too small keeps >= 0.8x the roomy pool's tokens/s.
PREFIX_TTFT_CUT, PREFIX_TOK_S = 3.0, 1.5
OVERASK_SEQUENCES, OVERASK_TOK_S = 3.0, 2.0
PRESSURE_TOK_S = 0.8


def details(runs: tuple[Run, ...], outputs_equal: str) -> dict[str, Any]:
    """What the tables show, per configuration, and the worker's statistics over the measured run."""
    return {
        "runs": {
            run.name: {
                "wall_s": run.wall_s,
                "tokens": run.tokens,
                "tok_s": run.tokens_per_s,
                "ttft_p50_ms": run.ttft_ms(0.5),
                "ttft_p99_ms": run.ttft_ms(0.99),
                "sequences_per_step": run.sequences_per_step,
                "engine": run.engine,
            }
            for run in runs
        },
        "greedy_outputs_equal": outputs_equal,
    }


def prefix_experiment(args: Any, sitting: Sitting) -> str:
    rng = random.Random(args.seed)
    system = random_text(rng, 512)
    requests = [Request(system + random_text(rng, rng.randint(16, 64)), 32, 32) for _ in range(64)]
    warmup = [Request(random_text(rng, 540), 4, 4) for _ in range(4)]  # another prefix: nothing to reuse
    batch = ["--max-batch-size", str(args.max_batch_size)]
    off = measure("prefix-off", [*batch, "--no-prefix-caching"], requests, warmup, args)
    on = measure("prefix-on", batch, requests, warmup, args)
    rows = [
        [
            run.name,
            f"{run.ttft_ms(0.5):,.0f}",
            f"{run.ttft_ms(0.99):,.0f}",
            f"{run.tokens_per_s:.1f}",
            f"{run.engine['prefill_tokens_total']:,.0f}",
            f"{run.engine.get('prefix_cache_hits_tokens_total', 0):,.0f}",
        ]
        for run in (off, on)
    ]
    rows.append(
        [
            "on ÷ off",
            f"{on.ttft_ms(0.5) / off.ttft_ms(0.5):.2f}× (p50 {off.ttft_ms(0.5) / on.ttft_ms(0.5):.1f}× lower)",
            f"{on.ttft_ms(0.99) / off.ttft_ms(0.99):.2f}×",
            f"{on.tokens_per_s / off.tokens_per_s:.2f}×",
            "",
            "",
        ]
    )
    equal = same_outputs(off, on)
    what, baseline = "shared 512-token prompt, prefix caching on", "prefix caching off"
    sitting.figure(
        f"TTFT p50, {what}",
        on.ttft_ms(0.5),
        "ms",
        baseline=(baseline, off.ttft_ms(0.5)),
        bar=f"<= {1 / PREFIX_TTFT_CUT:.2f}x ({PREFIX_TTFT_CUT:g}x lower)",
        met=off.ttft_ms(0.5) / on.ttft_ms(0.5) >= PREFIX_TTFT_CUT,
        note=f"greedy outputs equal, on vs off: {equal}",
    )
    sitting.figure(
        f"tok/s, {what}",
        on.tokens_per_s,
        "tok/s",
        baseline=(baseline, off.tokens_per_s),
        bar=f">= {PREFIX_TOK_S:g}x",
        met=on.tokens_per_s / off.tokens_per_s >= PREFIX_TOK_S,
    )
    sitting.figure(f"TTFT p99, {what}", on.ttft_ms(0.99), "ms", baseline=(baseline, off.ttft_ms(0.99)), headline=False)
    sitting.details = details((off, on), equal)
    headers = ["prefix caching", "TTFT p50 ms", "TTFT p99 ms", "tokens/s", "prefill tokens", "cache hits (tokens)"]
    return markdown_table(headers, rows) + f"\n\nGreedy outputs equal, on vs off: {equal} requests."


def overask_experiment(args: Any, sitting: Sitting) -> str:
    rng = random.Random(args.seed + 1)
    requests = [Request(random_text(rng, rng.randint(32, 64)), 512, rng.randint(16, 64)) for _ in range(96)]
    warmup = [Request(random_text(rng, 48), 8, 8) for _ in range(4)]
    common = ["--max-batch-size", str(args.max_batch_size), "--kv-cache-tokens", "8192"]
    worst = measure("worst-case", [*common, "--kv-reservation", "worst-case"], requests, warmup, args)
    paged = measure("paged", common, requests, warmup, args)
    rows = [
        [run.name, f"{run.sequences_per_step:.1f}", f"{run.tokens_per_s:.1f}", f"{run.wall_s:.1f}"]
        for run in (worst, paged)
    ]
    rows.append(
        [
            "paged ÷ worst-case",
            f"{paged.sequences_per_step / worst.sequences_per_step:.2f}×",
            f"{paged.tokens_per_s / worst.tokens_per_s:.2f}×",
            "",
        ]
    )
    equal = same_outputs(worst, paged)
    baseline = "worst-case reservation"
    sitting.figure(
        "sequences per step, paged KV, over-asking clients",
        paged.sequences_per_step,
        "sequences",
        baseline=(baseline, worst.sequences_per_step),
        bar=f">= {OVERASK_SEQUENCES:g}x",
        met=paged.sequences_per_step / worst.sequences_per_step >= OVERASK_SEQUENCES,
        note=f"greedy outputs equal, paged vs worst-case: {equal}",
    )
    sitting.figure(
        "useful tok/s, paged KV, over-asking clients",
        paged.tokens_per_s,
        "tok/s",
        baseline=(baseline, worst.tokens_per_s),
        bar=f">= {OVERASK_TOK_S:g}x",
        met=paged.tokens_per_s / worst.tokens_per_s >= OVERASK_TOK_S,
    )
    sitting.details = details((worst, paged), equal)
    headers = ["--kv-reservation", "sequences per step", "useful tokens/s", "wall s"]
    return markdown_table(headers, rows) + f"\n\nGreedy outputs equal, paged vs worst-case: {equal}."


def pressure_experiment(args: Any, sitting: Sitting) -> str:
    rng = random.Random(args.seed + 2)
    requests = [Request(random_text(rng, rng.randint(32, 64)), 96, 96) for _ in range(48)]
    warmup = [Request(random_text(rng, 48), 8, 8) for _ in range(4)]
    batch = ["--max-batch-size", "32"]
    roomy = measure("roomy", [*batch, "--kv-cache-tokens", "16384"], requests, warmup, args)
    tight = measure("tight", [*batch, "--kv-cache-tokens", str(args.tight_kv_tokens)], requests, warmup, args)
    rows = [
        [
            f"{run.name} (--kv-cache-tokens {16384 if run is roomy else args.tight_kv_tokens})",
            f"{run.engine.get('preemptions_total', 0):.0f}",
            f"{sum(len(o.tokens) == 96 for o in run.outcomes)}/{len(run.outcomes)}",
            f"{run.sequences_per_step:.1f}",
            f"{run.tokens_per_s:.1f}",
        ]
        for run in (roomy, tight)
    ]
    rows.append(["tight ÷ roomy", "", "", "", f"{tight.tokens_per_s / roomy.tokens_per_s:.2f}×"])
    equal = same_outputs(roomy, tight)
    whole = sum(len(o.tokens) == 96 for o in tight.outcomes)
    sitting.figure(
        "tok/s, KV pool too small for the running set",
        tight.tokens_per_s,
        "tok/s",
        baseline=("roomy pool", roomy.tokens_per_s),
        bar=f">= {PRESSURE_TOK_S:g}x",
        met=tight.tokens_per_s / roomy.tokens_per_s >= PRESSURE_TOK_S,
        note=f"greedy outputs equal, tight vs roomy: {equal}",
    )
    sitting.figure("preemptions, KV pool too small", tight.engine.get("preemptions_total", 0), "preemptions")
    sitting.figure(
        "requests finished whole, KV pool too small",
        100 * whole / len(tight.outcomes),
        "%",
        bar="100%",
        met=whole == len(tight.outcomes),
    )
    sitting.details = details((roomy, tight), equal)
    headers = ["pool", "preemptions", "finished whole", "sequences per step", "tokens/s"]
    return markdown_table(headers, rows) + f"\n\nGreedy outputs equal, tight vs roomy: {equal}."


EXPERIMENTS = {"prefix": prefix_experiment, "overask": overask_experiment, "pressure": pressure_experiment}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="prefix,overask,pressure")
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--dtype", default="float32", help="float32 by default: outputs are compared exactly")
    parser.add_argument("--threads", type=int, default=0, help="the worker's torch threads; 0 = its default")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--tight-kv-tokens", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"machine: {machine()}; model {args.model}, {args.dtype}", flush=True)
    for name in args.experiments.split(","):
        sitting = Sitting(("govwire", "governor", "worker"), part=name)  # one result file per experiment
        print(f"\n## {name}", flush=True)
        report = EXPERIMENTS[name](args, sitting)
        print(report, flush=True)
        sitting.write()


if __name__ == "__main__":
    main()
