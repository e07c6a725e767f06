"""The worker on a small host: served ITL with and without a load generator on the same cores.

    python -m benchmarks.engine.small_host [--rounds 2] [--share 0.6]

A governor with a GPT-2 worker (random weights, CPU) serves `governor bench` running in this
process on the same cores (8 streams at a time, 32-token prompts, 32 new tokens), alone and
beside a CPU burner taking --share of a core (benchmarks/harness/burn.py: a heavier load generator such
as aiperf or guidellm, whose client processes compete for the cores). For each worker setting:
the default (torch's threads = the cores, OpenMP threads spinning between parallel regions),
`OMP_WAIT_POLICY=PASSIVE` (they sleep at once) and `--threads 1` (a core left to the client).
Reports the ITL p50 / p99 and tokens/s, medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from benchmarks.harness import rounds
from benchmarks.harness.common import HARNESS, bench, machine, markdown_table, start_governor, stop
from benchmarks.harness.results import Sitting

SETTINGS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "default": ({}, ()),
    "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, ()),
    "--threads 1": ({}, ("--threads", "1")),
}


def measure(env: dict[str, str], flags: tuple[str, ...], share: float) -> tuple[float, float, float]:
    previous = os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ.update(env)  # the spawned worker inherits the governor's environment
    try:
        gov, port = start_governor("--max-inflight", "64", worker_args=("--engine", "gpt2", *flags), timeout=300)
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        if previous is not None:
            os.environ["OMP_WAIT_POLICY"] = previous
    burner = None
    if share:
        burner = subprocess.Popen([sys.executable, str(HARNESS / "burn.py"), "--share", str(share)])
    try:
        summary, _ = bench(
            f"127.0.0.1:{port}",
            num_requests=24,
            concurrency=8,
            max_new_tokens=32,
            stop_on_eos=False,
            prompt_len_dist="fixed:32",
            seed=1,
            warmup_runs=1,
        )
    finally:
        if burner is not None:
            burner.terminate()
            burner.wait()
        stop(gov)
    assert summary.itl_ms.p50 is not None and summary.itl_ms.p99 is not None
    return summary.itl_ms.p50, summary.itl_ms.p99, summary.output_tok_s


THREADS_BAR = 1.5  # --threads 1 beside a client: ITL p50 within 1.5x the default alone (issue 36)


def record(sitting: Sitting, name: str, share: float, p50: float, alone: float) -> None:
    """One row's ITL p50 against the default worker alone, as the table's last column; the default
    and `--threads 1` beside the client are the headline (what the README's advice rests on)."""
    beside = share > 0
    held = name == "--threads 1" and beside
    sitting.figure(
        f"ITL p50, {name}, " + (f"beside a {share:g}-core client" if beside else "alone"),
        p50,
        "ms",
        baseline=("default worker alone", alone),
        bar=f"<= {THREADS_BAR:g}x" if held else None,
        met=p50 / alone <= THREADS_BAR if held else None,
        headline=beside and name in ("default", "--threads 1"),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--share", type=float, default=0.6, help="the burner's share of one core")
    a = p.parse_args()
    sitting = Sitting(("govwire", "governor", "worker"))
    print(f"machine: {machine()}")
    results: dict[tuple[str, float], list[tuple[float, float, float]]] = {}
    for r in range(a.rounds):
        for name in rounds.order(r, list(SETTINGS)):
            env, flags = SETTINGS[name]
            for share in (0.0, a.share):
                row = measure(env, flags, share)
                results.setdefault((name, share), []).append(row)
                p50, p99, tok_s = row
                print(
                    f"round {r + 1} {name:>24} burner {share:.1f}:"
                    f" ITL p50 {p50:.1f} / p99 {p99:.1f} ms, {tok_s:.1f} tok/s"
                )
    alone = statistics.median(x[0] for x in results[("default", 0.0)])
    rows, details = [], []
    for (name, share), runs in results.items():
        p50, p99, tok_s = (statistics.median(x[i] for x in runs) for i in range(3))
        rows.append([name, f"{share:.1f}", f"{p50:.1f}", f"{p99:.1f}", f"{tok_s:.1f}", f"{p50 / alone:.2f}x"])
        fields = ("itl_p50_ms", "itl_p99_ms", "tok_s")
        details.append(
            {
                "worker": name,
                "burner_share": share,
                "medians": dict(zip(fields, (p50, p99, tok_s), strict=True)),
                "rounds": [dict(zip(fields, run, strict=True)) for run in runs],
            }
        )
        if (name, share) != ("default", 0.0):
            record(sitting, name, share, p50, alone)
    print()
    headers = ["worker", "burner (cores)", "ITL p50 ms", "ITL p99 ms", "tok/s", "ITL p50 / default alone"]
    print(markdown_table(headers, rows))
    sitting.details = {"rows": details}
    sitting.write()


if __name__ == "__main__":
    main()
