"""The printed report of one run, and its JSON form."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from governor.bench.config import BenchConfig
from governor.bench.runner import RunResult
from governor.bench.stats import Distribution, RequestSample, Summary, summarize
from governor.bench.tenants import TenantGroup


def run_summary(config: BenchConfig, samples: Sequence[RequestSample], wall_s: float) -> Summary:
    """The figures of some of a run's requests under its SLOs and deadline, over the whole run's
    wall time: of all of them for the summary, of one --tenant-mix group's for its line."""
    return summarize(samples, wall_s, config.slo_ttft_ms or None, config.slo_tpot_ms or None, config.deadline_ms)


def group_summaries(config: BenchConfig, result: RunResult) -> list[tuple[TenantGroup, Summary]]:
    """Each --tenant-mix group's summary, in the order the spec names them; none without a mix."""
    return [
        (group, run_summary(config, [s for s in result.samples if s.group == group.label], result.wall_s))
        for group in config.tenant_groups()
    ]


def token_share(part: Summary, whole: Summary) -> float:
    """The share of the run's served tokens (prompt and completion, of completed requests) `part` got."""
    return part.tokens / whole.tokens if whole.tokens else 0.0


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def _num(x: float | None) -> str:
    return "        -" if x is None else f"{x:9.2f}"


def _dist(name: str, d: Distribution) -> str:
    if not d.count:
        return f"  {name:<24} -"
    return f"  {name:<24} p50 {_num(d.p50)}  p95 {_num(d.p95)}  p99 {_num(d.p99)}  mean {_num(d.mean)}  (n={d.count})"


# The server's timings from `done` (docs/protocol.md), in the order of a request's life.
SERVER_TIMINGS = {
    "queue_wait_ms": "Queue wait (worker)",
    "prefill_ms": "Prefill->first token",
    "worker_ttft_ms": "TTFT (worker)",
    "ttft_ms": "TTFT (governor)",
    "decode_ms": "Decode (worker)",
    "total_ms": "Latency (governor)",
}


def server_distributions(result: RunResult) -> dict[str, Distribution]:
    """The server's own timings from `done`, beside the client's, under readable names."""
    present = {k for s in result.samples if s.status == "done" for k in s.server}
    keys = [k for k in SERVER_TIMINGS if k in present] + sorted(present - SERVER_TIMINGS.keys())
    return {
        SERVER_TIMINGS.get(k, k): Distribution.of([s.server[k] for s in result.samples if k in s.server]) for k in keys
    }


def format_run(title: str, config: BenchConfig, summary: Summary, result: RunResult) -> str:
    schedule = "closed loop" if config.concurrency else f"{config.submit_schedule}, {config.submit_interval_ms} ms"
    if result.submit_wall_s > 0:
        schedule += f"; arrivals {result.arrival_rate:.1f} req/s"
    errors = _counts(summary.errors) or "none"
    reasons = _counts(summary.yielded_by_reason)
    lines = [
        f"== {title}",
        f"  Requests (accepted, done) {summary.requests}",
        f"  Yielded                  {summary.yielded}" + (f" ({reasons})" if reasons else ""),
        f"  Errors                   {errors}",
        f"  Retries                  {summary.retries} (amplification {summary.retry_amplification:.2f} attempts"
        " per completed request)",
        f"  Goodput                  {summary.goodput_rps:.2f} req/s"
        f" (SLO ttft {config.slo_ttft_ms or '-'} ms, tpot {config.slo_tpot_ms or '-'} ms)",
        *(
            [
                f"  Deadlines ({config.deadline_ms:g} ms)     met {d.met} of {d.met + d.missed} admitted"
                f" ({d.met_share:.1%}), missed {d.missed}, refused {d.refused}"
            ]
            if (d := summary.deadlines) is not None
            else []
        ),
        f"  Prompt tokens            {summary.prompt_tokens}",
        f"  Completion tokens        {summary.completion_tokens}",
        f"  Wall                     {summary.wall_s:.3f} s",
        f"  Submit wall              {result.submit_wall_s:.3f} s ({schedule})",
        f"  Throughput               {summary.output_tok_s:.1f} completion tok/s,"
        f" {summary.total_tok_s:.1f} total tok/s",
        "  client timings (ms):",
    ]
    if result.submit_lags_s:
        lines.append(_dist("Submit lag", Distribution.of([x * 1000 for x in result.submit_lags_s])))
    lines += [
        _dist("Submit->ack", summary.ack_ms),
        _dist("Yield latency", summary.yield_latency_ms),
        _dist("TTFT", summary.ttft_ms),
        _dist("TPOT", summary.tpot_ms),
        _dist("ITL", summary.itl_ms),
        _dist("Latency", summary.latency_ms),
        "  server timings from done (ms):",
    ]
    lines += [_dist(k, d) for k, d in server_distributions(result).items()]
    groups = group_summaries(config, result)
    if groups:
        lines += _group_lines(config, summary, groups)
    return "\n".join(lines)


def _group_lines(config: BenchConfig, summary: Summary, groups: list[tuple[TenantGroup, Summary]]) -> list[str]:
    """One line per --tenant-mix group: what it offered, what became of it, and the share of the
    service it got, to see who pays for an overload."""
    width = max(5, *(len(group.label) for group, _ in groups))
    slo = bool(config.slo_ttft_ms or config.slo_tpot_ms)
    head = f"  {'group':<{width}} {'offered':>7} {'done':>6} {'yielded':>7} {'errors':>6} {'retries':>7} {'done/s':>8}"
    lines = [
        "  per --tenant-mix group (TTFT in ms; tokens: its share of all prompt and completion tokens served):",
        head + (f" {'goodput/s':>9}" if slo else "") + f" {'TTFT p50':>9} {'TTFT p99':>9} {'tokens':>7}",
    ]
    for group, s in groups:
        row = (
            f"  {group.label:<{width}} {s.offered:>7} {s.requests:>6} {s.yielded:>7} {sum(s.errors.values()):>6}"
            f" {s.retries:>7} {s.executed_rps:>8.2f}"
        )
        row += (f" {s.goodput_rps:>9.2f}" if slo else "") + f" {_num(s.ttft_ms.p50)} {_num(s.ttft_ms.p99)}"
        row += f" {token_share(s, summary):>7.1%}"
        reasons = _counts(s.yielded_by_reason)
        lines.append(row + (f"  yields: {reasons}" if reasons else ""))
    return lines


def to_json(config: BenchConfig, runs: list[tuple[Summary, RunResult]]) -> dict[str, Any]:
    return {
        "config": asdict(config),
        "runs": [
            {
                "summary": asdict(summary),
                "groups": [
                    {
                        "group": group.label,
                        "tenant": group.tenant or None,
                        "priority": group.priority,
                        "mix_share": group.share,
                        "executed_rps": part.executed_rps,
                        "token_share": token_share(part, summary),
                        "summary": asdict(part),
                    }
                    for group, part in group_summaries(config, result)
                ],
                "submit_lags_s": result.submit_lags_s,
                "timeline": result.timeline,
                "samples": [asdict(s) for s in result.samples],
            }
            for summary, result in runs
        ],
    }
