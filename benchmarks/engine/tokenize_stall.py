"""Do running streams stall while a huge prompt is tokenized? Inter-token latency around a 1 MiB prompt.

    python -m benchmarks.engine.tokenize_stall [--model DIR] [--streams 16] [--prompt-mib 1] [--rounds 3]

A governor with its GPT-2 worker (default: benchmarks/harness/model_dir.py's GPT-2 small with a 50,257-entry
BPE, whose tokenizer costs what a real one does). In each round, `--streams` greedy requests decode
side by side; once every one of them has streamed a few tokens, a request with a `--prompt-mib`
prompt arrives. It is far beyond GPT-2's context, so the worker refuses it with `bad_frame`, but
only after tokenizing it. The script reports the streams' inter-token gaps that overlap the big
request's life (sent -> refusal read) against the gaps before it was sent, and how long the
refusal took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import model_dir
from benchmarks.harness.common import machine, markdown_table, out_dir, start_governor, stop
from benchmarks.harness.results import Sitting
from governor.bench.stats import percentile
from governor.client import AsyncClient
from govwire.errors import BadFrame


@dataclass
class Round:
    gaps_before: list[float] = field(default_factory=list)  # ms
    gaps_during: list[float] = field(default_factory=list)
    refusal_ms: float = 0.0


async def one_round(port: int, streams: int, new_tokens: int, big: str) -> Round:
    steady_tokens = min(8, new_tokens // 2)  # every stream has streamed this many before the big prompt
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    steady = asyncio.Event()
    window: list[float] = []
    async with AsyncClient("127.0.0.1", port, timeout=None) as client:

        async def stream(i: int) -> None:
            prompt = f"stream {i}: the quick brown fox jumps over the lazy dog, again and again"
            async with client.stream(prompt, max_new_tokens=new_tokens, temperature=0.0, stop_on_eos=False) as s:
                async for _ in s:
                    arrivals[i].append(time.perf_counter())
                    if all(len(a) >= steady_tokens for a in arrivals):
                        steady.set()

        async def huge() -> None:
            await steady.wait()
            window.append(time.perf_counter())
            try:
                await client.generate(big, max_new_tokens=1)
                raise RuntimeError("the huge prompt was accepted: it should exceed the model's context")
            except BadFrame:
                window.append(time.perf_counter())

        await asyncio.gather(huge(), *(stream(i) for i in range(streams)))
    sent, refused = window
    result = Round(refusal_ms=(refused - sent) * 1000)
    for times in arrivals:
        for a, b in zip(times, times[1:], strict=False):
            if b <= sent:
                result.gaps_before.append((b - a) * 1000)
            elif a < refused:  # the gap overlaps the big request's life
                result.gaps_during.append((b - a) * 1000)
    return result


def summary(r: Round) -> dict[str, float]:
    """One round's row of the table, in numbers."""
    return {
        "itl_p50_before_ms": statistics.median(r.gaps_before),
        "itl_p99_before_ms": percentile(r.gaps_before, 99),
        "itl_p50_during_ms": statistics.median(r.gaps_during),
        "itl_p99_during_ms": percentile(r.gaps_during, 99),
        "max_gap_during_ms": max(r.gaps_during),
        "refusal_ms": r.refusal_ms,
    }


def record(sitting: Sitting, rows: list[dict[str, float]], mib: float) -> None:
    """Medians over rounds: the streams' ITL p99 while the prompt is tokenized against before it
    came, and their longest gap, are the headline; ITL p50 and the refusal's delay beside them."""

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    during, before = f"while a {mib:g} MiB prompt is tokenized", "before it arrived"
    sitting.figure(
        f"ITL p99 {during}", median("itl_p99_during_ms"), "ms", baseline=(before, median("itl_p99_before_ms"))
    )
    sitting.figure(f"longest inter-token gap {during}", median("max_gap_during_ms"), "ms")
    sitting.figure(
        f"ITL p50 {during}",
        median("itl_p50_during_ms"),
        "ms",
        baseline=(before, median("itl_p50_before_ms")),
        headline=False,
    )
    sitting.figure(f"{mib:g} MiB prompt refused after", median("refusal_ms"), "ms", headline=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: benchmarks/harness/model_dir.py's directory")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompt-mib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sitting = Sitting(("govwire", "governor", "worker"))

    model = args.model or model_dir.ensure()
    text = Path(json.__file__).parent.parent.joinpath("typing.py").read_text()
    size = int(args.prompt_mib * (1 << 20))
    big = (text * (size // len(text) + 1))[:size]
    frame_limit = str(size + (1 << 20))
    print(f"machine: {machine()}; model {model}; {args.streams} streams; prompt {len(big.encode()):,} bytes")
    proc, port = start_governor(
        "--max-inflight", "64", "--max-frame-bytes", frame_limit, "--max-buffer-bytes", str(4 * int(frame_limit)),
        worker_args=("--engine", "gpt2", "--model", str(model), "--max-batch-size", str(args.streams)),
        log=out_dir() / "tokenize_stall.log", timeout=300,
    )  # fmt: skip
    rounds: list[Round] = []
    try:
        asyncio.run(one_round(port, 2, 16, "warm up " * 10_000))  # first steps, first big tokenization
        for _ in range(args.rounds):
            rounds.append(asyncio.run(one_round(port, args.streams, args.new_tokens, big)))
    finally:
        stop(proc)
    summaries = [summary(r) for r in rounds]
    rows = [  # the gaps to 0.1 ms, the refusal to 1 ms
        [str(i), *(f"{v:.1f}" for k, v in row.items() if k != "refusal_ms"), f"{row['refusal_ms']:.0f}"]
        for i, row in enumerate(summaries, 1)
    ]
    print(
        markdown_table(
            [
                "round",
                "ITL p50 before (ms)",
                "ITL p99 before (ms)",
                "ITL p50 during (ms)",
                "ITL p99 during (ms)",
                "max gap during (ms)",
                "huge prompt refused after (ms)",
            ],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rounds], indent=2))
    record(sitting, summaries, args.prompt_mib)
    sitting.details = {
        "model": str(model),
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        "prompt_bytes": len(big.encode()),
        "rounds": summaries,
    }
    sitting.write()


if __name__ == "__main__":
    main()
