"""Experiment 6: a load sweep from 10% to 150% of measured capacity, with and without the cap.

Two governors, each with its own GPT-2 worker (random weights, decode batch `--batch`): one with
`--max-inflight` equal to the batch, one with no cap in practice. Capacity is measured first as
the completed requests/s of a closed loop keeping `--batch` requests in flight through the capped
governor. Then, for each rate, an open loop on the absolute schedule offers that rate for about
`--seconds` to each governor in turn; a yield is final (no retries). Per rate and configuration:
goodput (requests meeting the TTFT SLO, per second), yield ratio, TTFT p99 of completed requests.

    python -m benchmarks.admission.load_sweep [--seconds 10] [--rates 10,25,50,75,90,100,110,125,150]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from subprocess import Popen
from typing import Any

from benchmarks.harness import rounds
from benchmarks.harness.common import UNLIMITED, bench, machine, markdown_table, ms, out_dir, start_governor, stop
from benchmarks.harness.results import Sitting


def write_plot(path: Path, points: dict[str, list[dict[str, Any]]], slo_ms: float, capacity: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("goodput_rps", f"goodput (req/s with TTFT ≤ {slo_ms:g} ms)", "linear"),
        ("yield_ratio", "yield ratio", "linear"),
        ("ttft_p99_ms", "TTFT p99 of completed requests (ms)", "log"),
    )
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for name, rows in points.items():
            ax.plot([r["offered_pct"] for r in rows], [r[key] for r in rows], marker="o", label=name)
        ax.set(xlabel=f"offered load (% of capacity, {capacity:.2f} req/s)", title=title, yscale=scale)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def record(sitting: Sitting, points: dict[str, list[dict[str, Any]]], cap: str, capacity: float) -> None:
    """The sweep's most overloaded point (its highest rate), capped against unlimited."""
    capped, unlimited = max(zip(points[cap], points["unlimited"], strict=True), key=lambda pair: pair[0]["offered_pct"])
    load = f"{capped['offered_pct']:g}% of capacity"
    for name, key, unit in (("goodput", "goodput_rps", "req/s"), ("TTFT p99", "ttft_p99_ms", "ms")):
        sitting.figure(f"{name} at {load}, {cap}", capped[key], unit, baseline=("unlimited", unlimited[key]))
    sitting.figure(f"yielded at {load}, {cap}", 100 * capped["yield_ratio"], "%", headline=False)
    sitting.figure("capacity, closed loop", capacity, "req/s", headline=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="arrivals per point last about this long")
    parser.add_argument("--rates", default="10,25,50,75,90,100,110,125,150", help="percent of measured capacity")
    parser.add_argument("--batch", type=int, default=8, help="the worker's decode batch, and the governor's cap")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--prompt-repeats", type=int, default=6, help="'Hello' repeated: 5 tokens each (bytes)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model", default="random-gpt2")
    args = parser.parse_args()
    sitting = Sitting(measures=("govwire", "governor", "worker"))
    worker = ("--engine", "gpt2", "--model", args.model, "--max-batch-size", str(args.batch))
    workload: dict[str, Any] = {
        "prompt": "Hello",
        "prompt_repeats": args.prompt_repeats,
        "unique_prompts": True,
        "max_new_tokens": args.max_new_tokens,
        "stop_on_eos": False,
        "slo_ttft_ms": args.slo_ttft_ms,
    }
    configs = {f"--max-inflight {args.batch}": args.batch, "unlimited": UNLIMITED}
    governors: dict[str, tuple[Popen, int]] = {}
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    try:
        for name, cap in configs.items():
            log = out_dir() / f"sweep_{cap}.log"
            governors[name] = start_governor("--max-inflight", str(cap), worker_args=worker, log=log, timeout=180)
        addresses = {name: f"127.0.0.1:{port}" for name, (_, port) in governors.items()}
        for address in addresses.values():
            bench(address, num_requests=2 * args.batch, concurrency=args.batch, **workload)  # warm-up
        print("\n### capacity: closed loop", flush=True)
        summary, _ = bench(
            addresses[f"--max-inflight {args.batch}"], num_requests=6 * args.batch, concurrency=args.batch, **workload
        )
        capacity = summary.requests / summary.wall_s
        for pct in (float(x) for x in args.rates.split(",")):
            rate = capacity * pct / 100
            count = max(5, round(rate * args.seconds))
            for name in rounds.order(len(points[f"--max-inflight {args.batch}"]), list(configs)):
                print(f"\n### {pct:g}% of capacity ({rate:.2f} req/s), {name}", flush=True)
                summary, _ = bench(
                    addresses[name], num_requests=count, submit_interval_ms=1000 / rate, timeout_s=600, **workload
                )
                points[name].append(
                    {
                        "offered_pct": pct,
                        "offered_rps": rate,
                        "requests": count,
                        "goodput_rps": summary.goodput_rps,
                        "yield_ratio": summary.yielded / count,
                        "ttft_p99_ms": summary.ttft_ms.p99,
                        "completed_rps": summary.requests / summary.wall_s,
                    }
                )
    finally:
        for proc, _ in governors.values():
            stop(proc)
    print(f"\nmachine: {machine()}")
    print(f"capacity (closed loop, {args.batch} in flight): {capacity:.2f} req/s; TTFT SLO {args.slo_ttft_ms:g} ms\n")
    rows = []
    capped, unlimited = points[f"--max-inflight {args.batch}"], points["unlimited"]
    for c, u in zip(capped, unlimited, strict=True):
        rows.append(
            [
                f"{c['offered_pct']:g}% ({c['offered_rps']:.2f})",
                f"{c['goodput_rps']:.2f} / {u['goodput_rps']:.2f}",
                f"{c['yield_ratio']:.2f} / {u['yield_ratio']:.2f}",
                f"{ms(c['ttft_p99_ms'])} / {ms(u['ttft_p99_ms'])}",
            ]
        )
    headers = ["offered (req/s)", "goodput capped / unlimited", "yield ratio", "TTFT p99 (ms) capped / unlimited"]
    print(markdown_table(headers, rows))
    plot = out_dir() / "load_sweep.png"
    write_plot(plot, points, args.slo_ttft_ms, capacity)
    print(f"\nplot: {plot}")
    record(sitting, points, f"--max-inflight {args.batch}", capacity)
    sitting.details = {"capacity_rps": capacity, "slo_ttft_ms": args.slo_ttft_ms, "points": points}
    sitting.write()


if __name__ == "__main__":
    main()
