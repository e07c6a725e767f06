"""`--plot`: TTFT CDF per run, and the governor's inflight and yields per second over time."""

from __future__ import annotations

from pathlib import Path

from governor.bench.runner import RunResult


def write_plot(path: Path, runs: list[tuple[str, RunResult]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, result in runs:
        ttft = sorted(t * 1000 for s in result.samples if (t := s.ttft) is not None)
        if ttft:
            cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label)
        if result.timeline:
            times = [t for t, _, _ in result.timeline]
            timeline.plot(times, [n for _, n, _ in result.timeline], label=f"{label}: inflight")
            rates = [
                (y1 - y0) / (t1 - t0) if t1 > t0 else 0.0
                for (t0, _, y0), (t1, _, y1) in zip(result.timeline, result.timeline[1:], strict=False)
            ]
            timeline.plot(times[1:], rates, linestyle="--", label=f"{label}: yields/s")
    cdf.set(xlabel="TTFT (ms)", ylabel="share of completed requests", title="TTFT CDF")
    timeline.set(xlabel="seconds since the run started", title="governor: inflight and yields/s", yscale="symlog")
    for ax in (cdf, timeline):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
