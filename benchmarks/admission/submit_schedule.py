"""Experiment 3: relative vs absolute submit schedules, with and without a slow submit path.

A relative schedule sleeps `interval` after each submission, so the client's own time per
submission (tokenizing, building the request; `--submit-work-ms` blocks the client's event loop
that long without taking CPU from the server) adds to every gap, and the arrival rate drifts
with it: the TTFT it then reports measures a different load. An absolute schedule submits
request i at t0 + i·interval whatever the submit path costs, as long as it costs less than the
interval; its submit lag says whether it kept up.

One governor with the GPT-2 worker (random weights) serves all the runs: each round runs the four
combinations in turn.

    python -m benchmarks.admission.submit_schedule [--rounds 2] [--requests 100] [--interval-ms 100] [--work-ms 30]
"""

from __future__ import annotations

import argparse

from benchmarks.harness import rounds
from benchmarks.harness.common import bench, machine, markdown_table, ms, out_dir, start_governor, stop
from benchmarks.harness.results import Sitting
from governor.bench.stats import Distribution

Run = dict[str, float | None]  # one schedule and submit path in one round


def record(sitting: Sitting, by_round: list[dict[str, Run]], work_ms: float) -> None:
    """Each schedule with the slow submit path against the same schedule as is: medians over
    rounds, the ratio the median of each round's own."""
    slow_path = f"submit path +{work_ms:g} ms"

    def add(name: str, schedule: str, key: str, unit: str, headline: bool) -> None:
        slow, plain = f"{schedule} +{work_ms:g} ms", f"{schedule} +0 ms"
        sitting.figure(
            f"{name}, {schedule} schedule, {slow_path}",
            rounds.median(by_round, slow, lambda run: run[key]),
            unit,
            baseline=(f"{schedule}, submit path as is", rounds.median(by_round, plain, lambda run: run[key])),
            ratio=rounds.paired_ratio(by_round, slow, plain, lambda run: run[key]),
            headline=headline,
        )

    for schedule in ("relative", "absolute"):
        add("arrivals", schedule, "arrival_rps", "req/s", True)
    for schedule in ("relative", "absolute"):
        add("TTFT p99", schedule, "ttft_p99_ms", "ms", False)
    sitting.figure(
        f"submit lag p50, absolute schedule, {slow_path}",
        rounds.median(by_round, f"absolute +{work_ms:g} ms", lambda run: run["submit_lag_p50_ms"]),
        "ms",
        headline=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--interval-ms", type=float, default=100.0)
    parser.add_argument("--work-ms", type=float, default=30.0, help="the slow submit path's cost per request")
    parser.add_argument("--prompt-repeats", type=int, default=13, help="'Hello' repeated: 5 tokens each (bytes)")
    parser.add_argument("--model", default="random-gpt2")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor", "worker"))
    proc, port = start_governor(
        "--max-inflight",
        "1000",
        worker_args=("--engine", "gpt2", "--model", args.model),
        log=out_dir() / "schedule_governor.log",
        timeout=180,
    )
    address = f"127.0.0.1:{port}"
    workload = {"prompt": "Hello", "prompt_repeats": args.prompt_repeats, "max_new_tokens": 1, "stop_on_eos": False}
    rows = []
    by_round: list[dict[str, Run]] = []
    try:
        bench(address, num_requests=8, **workload)
        for i in range(args.rounds):
            by_round.append({})
            for schedule in ("relative", "absolute"):
                for work in (0.0, args.work_ms):
                    print(f"\n### {schedule}, submit path +{work} ms, round {i + 1}", flush=True)
                    summary, result = bench(
                        address,
                        num_requests=args.requests,
                        submit_interval_ms=args.interval_ms,
                        submit_schedule=schedule,
                        submit_work_ms=work,
                        **workload,
                    )
                    lag = Distribution.of([x * 1000 for x in result.submit_lags_s])
                    by_round[-1][f"{schedule} +{work:g} ms"] = {
                        "submit_wall_s": result.submit_wall_s,
                        "arrival_rps": result.arrival_rate,
                        "submit_lag_p50_ms": lag.p50,
                        "submit_lag_p99_ms": lag.p99,
                        "ttft_p50_ms": summary.ttft_ms.p50,
                        "ttft_p99_ms": summary.ttft_ms.p99,
                    }
                    rows.append(
                        [
                            str(i + 1),
                            schedule,
                            f"+{work:g} ms",
                            f"{result.submit_wall_s:.2f}",
                            f"{result.arrival_rate:.2f}",
                            f"{ms(lag.p50)} / {ms(lag.p99)}" if lag.count else "-",
                            ms(summary.ttft_ms.p50),
                            ms(summary.ttft_ms.p99),
                        ]
                    )
    finally:
        stop(proc)
    target = 1000 / args.interval_ms
    print(f"\nmachine: {machine()}; target arrival rate {target:.2f} req/s\n")
    headers = ["round", "schedule", "submit path", "submit wall (s)", "arrivals (req/s)", "submit lag p50 / p99 (ms)"]
    print(markdown_table([*headers, "TTFT p50 (ms)", "TTFT p99 (ms)"], rows))
    record(sitting, by_round, args.work_ms)
    sitting.details = {"target_arrival_rps": target, "rounds": by_round}
    sitting.write()


if __name__ == "__main__":
    main()
