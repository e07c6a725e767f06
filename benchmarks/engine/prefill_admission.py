"""Experiment 2: the prefill admission knob.

32 unique short prompts at once, 8 new tokens each, decode batch 8 (`--max-batch-size 8`), on
the GPT-2 worker (random weights). Three worker configurations:
- running set = decode batch (`--max-running 8`): the burst is served eight at a time;
- `--max-running 32 --prefill-max-batch-size 8`: admitted eight per step, taking turns at decode;
- `--max-running 32 --prefill-max-batch-size 32`: the whole burst prefilled in the first step.
The governor's cap is above 32, so nothing is yielded: only the worker's scheduling differs.

    python -m benchmarks.engine.prefill_admission [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.harness.common import bench, machine, markdown_table, median_ms, out_dir, start_governor, stop
from governor.bench.plot import write_plot
from governor.bench.runner import RunResult
from governor.bench.stats import Summary

CONFIGS = {
    "running 8 (= decode batch)": ("--max-running", "8", "--prefill-max-batch-size", "8"),
    "running 32, prefill admission 8": ("--max-running", "32", "--prefill-max-batch-size", "8"),
    "running 32, prefill admission 32": ("--max-running", "32", "--prefill-max-batch-size", "32"),
}


def run_one(knobs: tuple[str, ...], args: argparse.Namespace) -> tuple[Summary, RunResult]:
    worker = ("--engine", "gpt2", "--model", args.model, "--max-batch-size", "8", *knobs)
    proc, port = start_governor(
        "--max-inflight", "64", worker_args=worker, log=out_dir() / "prefill_governor.log", timeout=180
    )
    try:
        workload = {"prompt": "Hello", "unique_prompts": True, "max_new_tokens": 8, "stop_on_eos": False}
        return bench(f"127.0.0.1:{port}", num_requests=32, warmup_runs=1, **workload)
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the three configurations")
    parser.add_argument("--model", default="random-gpt2")
    args = parser.parse_args()
    results: dict[str, list[tuple[Summary, RunResult]]] = {name: [] for name in CONFIGS}
    for i in range(args.repeats):
        for name, knobs in CONFIGS.items():
            print(f"\n### {name} (round {i + 1})", flush=True)
            results[name].append(run_one(knobs, args))
    rows = []
    for name, runs in results.items():
        summaries = [s for s, _ in runs]
        rows.append(
            [
                name,
                median_ms(summaries, lambda s: s.ttft_ms.p50),
                median_ms(summaries, lambda s: s.ttft_ms.p99),
                median_ms(summaries, lambda s: s.tpot_ms.p50),
                median_ms(summaries, lambda s: s.tpot_ms.p99),
                median_ms(summaries, lambda s: s.latency_ms.p99),
                f"{statistics.median(s.output_tok_s for s in summaries):.1f}",
            ]
        )
    print(f"\nmachine: {machine()}; medians over {args.repeats} rounds, times in ms\n")
    headers = ["worker (decode batch 8)", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "latency p99"]
    print(markdown_table([*headers, "completion tok/s"], rows))
    plot = out_dir() / "prefill_admission.png"
    write_plot(plot, [(name, runs[-1][1]) for name, runs in results.items()])
    print(f"\nplot: {plot}")


if __name__ == "__main__":
    main()
