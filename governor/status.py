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


def _token_lines(after: dict[str, Any]) -> list[str]:
    """Token budgets, deadline outcomes and the adaptive limit, each only when in use. Read with
    `.get`: a governor older than these fields has none of them."""
    lines = []
    budget, rate = after.get("max_inflight_tokens") or 0, after.get("max_tokens_per_s") or 0.0
    if budget or rate:
        held = after.get("inflight_tokens", 0)
        parts = [f"{held}/{budget} tokens in flight" if budget else f"{held} tokens in flight"]
        if rate:
            level = after.get("token_rate_tokens")
            banked = "" if level is None else f" ({level:g} in its bucket)"
            parts.append(f"--max-tokens-per-s {rate:g}{banked}")
        lines.append("token budget: " + ", ".join(parts))
    deadlines = after.get("deadlines") or {}
    met, expired = deadlines.get("met", 0), deadlines.get("expired", 0)
    if met or expired:
        lines.append(f"deadlines since start: met {met}, expired {expired} ({expired / (met + expired):.1%} expired)")
    adaptive = after.get("adaptive_limit") or {}
    mode = adaptive.get("mode", "off")
    if mode != "off":
        knee = adaptive.get("knee")
        configured = after.get("configured_max_inflight", after["max_inflight"])
        lines.append(
            f"adaptive limit ({mode}): {adaptive.get('limit')}, knee {'not yet known' if knee is None else knee},"
            f" --max-inflight {configured}"
        )
    return lines


def render_status(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """Caps and load, rates over the interval, yields by reason, token budgets, deadlines and the
    adaptive limit when in use, and each endpoint's health."""
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
    lines.extend(_token_lines(after))
    lines.append(
        f"workers: {sum(w['up'] for w in after['workers'])}/{len(after['workers'])} up, "
        f"{after['worker_restarts']} restarts, {after['rerouted_total']} re-routed"
    )
    previous = {w["address"]: w for w in before["workers"]}
    for w in after["workers"]:
        caps = (
            ", ".join(f"{name} {w[name]:g}" for name in ("concurrency", "tokens", "qps") if w.get(name))
            or "no soft caps"
        )
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
