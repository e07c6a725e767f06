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
from operator import itemgetter

from benchmarks.harness import rounds
from benchmarks.harness.common import bench, machine, markdown_table, median_ms, out_dir, start_governor, stop
from benchmarks.harness.results import Sitting
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


def figures(summary: Summary) -> dict[str, float | None]:
    """One run's row of the table, in numbers."""
    return {
        "ttft_p50_ms": summary.ttft_ms.p50,
        "ttft_p99_ms": summary.ttft_ms.p99,
        "tpot_p50_ms": summary.tpot_ms.p50,
        "tpot_p99_ms": summary.tpot_ms.p99,
        "latency_p99_ms": summary.latency_ms.p99,
        "completion_tok_s": summary.output_tok_s,
    }


Round = dict[str, dict[str, float | None]]  # configuration -> its row in one round


def record(sitting: Sitting, runs: list[Round]) -> None:
    """The knob itself (prefill admission 32 against 8, both running 32) as the headline: TTFT p99
    and TPOT p50, medians over rounds as the table prints them; then what the running set buys
    (running 32 against 8)."""
    one, eight, thirty_two = CONFIGS
    comparisons = (
        (thirty_two, eight, "TTFT p99", "ttft_p99_ms", "ms", True),
        (thirty_two, eight, "TPOT p50", "tpot_p50_ms", "ms", True),
        (thirty_two, eight, "completion tok/s", "completion_tok_s", "tok/s", False),
        (eight, one, "TTFT p99", "ttft_p99_ms", "ms", False),
        (eight, one, "TPOT p50", "tpot_p50_ms", "ms", False),
    )
    medians = {name: {key: rounds.median(runs, name, itemgetter(key)) for key in runs[0][name]} for name in CONFIGS}
    for subject, baseline, what, key, unit, headline in comparisons:
        sitting.figure(
            f"{what}, {subject}",
            medians[subject][key],
            unit,
            baseline=(baseline, medians[baseline][key]),
            headline=headline,
        )
    sitting.details = {"medians": medians, "rounds": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the three configurations")
    parser.add_argument("--model", default="random-gpt2")
    args = parser.parse_args()
    sitting = Sitting(("govwire", "governor", "worker"))
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
    record(sitting, [{name: figures(runs[i][0]) for name, runs in results.items()} for i in range(args.repeats)])
    sitting.write()


if __name__ == "__main__":
    main()
