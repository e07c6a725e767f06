"""`governor status`: one screen an operator can read, from two `stats` snapshots.

Rates are the counters' differences over the interval between the snapshots, so the command
needs no Prometheus to say what the governor is doing right now.
"""

from __future__ import annotations

from typing import Any


def _rate(before: dict[str, Any], after: dict[str, Any], key: str, seconds: float) -> float:
    return float(after.get(key, 0) - before.get(key, 0)) / seconds


def _engine_rate(before: dict[str, Any], after: dict[str, Any], key: str, seconds: float) -> float | None:
    if key not in before or key not in after:
        return None
    return max(0.0, float(after[key] - before[key])) / seconds  # a restarted worker starts again at 0


def render_status(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """Caps and load, rates over the interval, yields by reason, and each endpoint's health."""
    lines = []
    cap = f"{after['inflight']}/{after['max_inflight']} in flight"
    qps = f", --max-qps {after['max_qps']:g} ({after['qps_tokens']:g} tokens)" if after.get("max_qps") else ""
    state = "DRAINING" if after["draining"] else "serving"
    lines.append(f"governor: {state}, {cap}{qps}, {after['connections']} connections")
    rates = ", ".join(
        f"{name} {_rate(before, after, key, seconds):.1f}/s"
        for name, key in (
            ("received", "received_total"),
            ("executed", "executed_total"),
            ("yielded", "yielded_total"),
            ("rejected", "rejected_total"),
            ("failed", "failed_total"),
        )
    )
    lines.append(f"last {seconds:g} s: {rates}")
    received = after["received_total"] - before["received_total"]
    if received:
        lines.append(f"yield ratio: {(after['yielded_total'] - before['yielded_total']) / received:.1%}")
    for title, key in (
        ("yields", "yielded_by_reason"),
        ("rejections", "rejected_by_reason"),
        ("failures", "failed_by_reason"),
    ):
        totals = {reason: n for reason, n in after[key].items() if n}
        if totals:
            lines.append(f"{title} since start: " + ", ".join(f"{reason} {n}" for reason, n in sorted(totals.items())))
    shed = {reason: n for reason, n in after.get("connections_shed", {}).items() if n}
    if shed:
        lines.append("connections shed: " + ", ".join(f"{reason} {n}" for reason, n in sorted(shed.items())))
    if after.get("service_time_ms") is not None:
        lines.append(f"observed service time: {after['service_time_ms']:.1f} ms")
    lines.append(
        f"workers: {sum(w['up'] for w in after['workers'])}/{len(after['workers'])} up, "
        f"{after['worker_restarts']} restarts, {after['rerouted_total']} re-routed"
    )
    previous = {w["address"]: w for w in before["workers"]}
    for w in after["workers"]:
        caps = ", ".join(f"{name} {w[name]:g}" for name in ("concurrency", "qps") if w[name]) or "no soft caps"
        line = (
            f"  {'up  ' if w['up'] else 'DOWN'} {w['address']}: {w['inflight']} in flight ({caps}), "
            f"executed {w['executed']}, failed {w['failed']}"
        )
        engine, old = w.get("engine", {}), previous.get(w["address"], {}).get("engine", {})
        tokens = _engine_rate(old, engine, "generated_tokens_total", seconds)
        if tokens is not None:
            line += f", {tokens:.0f} tok/s"
        if "running" in engine:
            line += f", running {engine['running']}, waiting {engine.get('waiting', 0)}"
        lines.append(line)
    return "\n".join(lines) + "\n"
