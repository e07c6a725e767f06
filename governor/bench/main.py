"""`governor bench`: warm-up runs, measured runs, the report and the JSON file."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

from governor.bench.config import BenchConfig
from governor.bench.report import format_run, run_summary, to_json
from governor.bench.runner import BenchRun, RunResult, make_prompts
from governor.bench.stats import Summary
from governor.bench.tenants import assign_groups
from govwire.errors import GovernorError


async def measure(config: BenchConfig) -> list[tuple[Summary, RunResult]]:
    """Warm-up runs, then the measured runs, each reported as it ends; the benchmark scripts call this."""
    rng = random.Random(config.seed)
    prompts = make_prompts(config, rng)
    groups = assign_groups(config.tenant_groups(), config.num_requests, rng)
    measured: list[tuple[Summary, RunResult]] = []
    for n in range(config.warmup_runs + config.repeat_runs):
        result = await BenchRun(config, prompts, groups, rng).run()
        summary = run_summary(config, result.samples, result.wall_s)
        if n < config.warmup_runs:
            print(f"warm-up run {n + 1}/{config.warmup_runs}: {summary.requests} done, {summary.yielded} yielded")
            continue
        measured.append((summary, result))
        print(format_run(f"run {len(measured)}/{config.repeat_runs}", config, summary, result), flush=True)
    return measured


def run_bench(config: BenchConfig) -> int:
    try:
        runs = asyncio.run(measure(config))
    except GovernorError as exc:  # refused (e.g. unauthorized)
        print(f"governor bench: error: {config.direct or config.address}: {exc}", file=sys.stderr)
        return 1
    if config.json:
        Path(config.json).write_text(json.dumps(to_json(config, runs)))
    if config.plot:
        from governor.bench.plot import write_plot

        write_plot(Path(config.plot), [(f"run {i + 1}", result) for i, (_, result) in enumerate(runs)])
    return 0
