"""`governor status`: one screen an operator can read, from two `stats` snapshots.

Rates are the counters' differences over the interval between the snapshots, so the command
needs no Prometheus to say what the governor is doing right now. A `stats` reply is a
`Snapshot.to_dict` (snapshot/reading.py), read here in that wire form: the page may be asking a
governor older than some of its fields, so those are read with `.get`.
"""

from __future__ import annotations

from typing import Any

TOP_TENANTS = 5
"""The tenants `governor status` lists, busiest first; the rest are counted."""
TOP_REASONS = 3
"""The yield reasons a tenant's or class's line names, most frequent over the interval first."""


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
        line = f"deadlines since start: met {met}, expired {expired} ({expired / (met + expired):.1%} expired)"
        coverage = deadlines.get("coverage")
        if coverage is not None:
            line += f"; first tokens within their prediction {coverage:.1%} (the margin aims at 95%)"
        lines.append(line)
    adaptive = after.get("adaptive_limit") or {}
    mode = adaptive.get("mode", "off")
    if mode != "off":
        knee = adaptive.get("knee")
        configured = after.get("configured_max_inflight", after["max_inflight"])
        speed = adaptive.get("speed")
        slower = f", engine at {1 / speed:.0%} of its line's speed" if knee is not None and speed else ""
        lines.append(
            f"adaptive limit ({mode}): {adaptive.get('limit')}, knee {'not yet known' if knee is None else knee}"
            f"{slower}, --max-inflight {configured}"
        )
    return lines


def _hint_lines(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Whether the retry hints held over the interval: the returns to appointments by outcome, and
    the forecasts' median error. Nothing when no client came back (or an older governor)."""
    now = (after.get("retry_hints") or {}).get("outcomes") or {}
    then = (before.get("retry_hints") or {}).get("outcomes") or {}
    lines = []
    for reason, counts in sorted(now.items()):
        delta = {outcome: n - then.get(reason, {}).get(outcome, 0) for outcome, n in counts.items()}
        returns = sum(n for outcome, n in delta.items() if outcome != "never")
        if not returns:
            continue
        again = delta.get("yielded_again", 0)
        parts = ", ".join(f"{outcome} {n}" for outcome, n in sorted(delta.items()) if n)
        lines.append(f"retry hints ({reason}): {parts}; {again / returns:.1%} of returns refused again")
    final = _delta(
        {"n": sum((before.get("final_by_reason") or {}).values())},
        {"n": sum((after.get("final_by_reason") or {}).values())},
        "n",
    )
    lobby = after.get("lobby") or {}
    answered = _delta(before.get("lobby") or {}, lobby, "answered_total")
    if final or answered or lobby.get("held"):
        lines.append(
            f"refused for good (past the promise horizon): {final:.0f}; lobby: {lobby.get('held', 0)} held now,"
            f" {answered:.0f} returning clients held and answered"
        )
    backfilled = _delta(before.get("retry_hints") or {}, after.get("retry_hints") or {}, "backfilled_total")
    if backfilled:
        lines.append(f"backfilled: {backfilled:.0f} admitted into slots kept for appointments due after they end")
    error = (after.get("retry_hints") or {}).get("forecast_relative_error_p50")
    if lines and error is not None:
        lines.append(f"release forecast: median error {error:.1%} of a service time")
    return lines


def _fleet_lines(after: dict[str, Any]) -> list[str]:
    """With --fleet: the lease's state, and per shared cap this replica's share and use against the
    fleet's. Read with `.get`: a governor older than fleets has no `fleet`."""
    fleet = after.get("fleet")
    if not fleet:
        return []
    state = fleet.get("state", "?")
    up = "up" if fleet.get("up") else "DOWN (no lease renewed)"
    lines = [
        f"fleet {fleet.get('key')} at {fleet.get('url')}: {up}, {state}, {fleet.get('replicas')} replicas,"
        f" renewal {fleet.get('renewal_ms', 0):.1f} ms"
    ]
    age = fleet.get("renewal_age_ms")
    if age is not None:
        lines[0] += f", renewed {age:.0f} ms ago"
    if state in ("holding", "local", "closed"):
        lines[0] += f" (lapsed: --fleet-unavailable {fleet.get('unavailable', state)}, now {state})"
    if fleet.get("lapsed"):
        lines[0] += f"; {fleet['lapsed']} lapsed replica(s) still reserved"
    if fleet.get("cuts"):
        lines[0] += f"; requests cut {fleet['cuts']} time(s)"
    for name, r in (fleet.get("resources") or {}).items():
        granted = f", granted {r['fleet_granted']:g}" if "fleet_granted" in r else ""
        lines.append(
            f"  {name}: share {r['share']:g} of {r['limit']:g}, using {r['used']:g};"
            f" fleet using {r['fleet_used']:g}, wanting {r['fleet_wants']:g}{granted}"
        )
    return lines


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    """A counter's growth, never negative (a tenant reloaded away and back starts again at 0)."""
    return max(0.0, float(after.get(key, 0) - before.get(key, 0)))


def _yields(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """`yielded 2.0/s (tenant_share 1.5/s, ...)`: the top reasons over the interval. The snapshots
    list only the reasons that are not 0."""
    line = f"yielded {_delta(before, after, 'yielded_total') / seconds:.1f}/s"
    old, new = before.get("yielded_by_reason") or {}, after.get("yielded_by_reason") or {}
    grown = {reason: _delta(old, new, reason) for reason in new}
    top = sorted(((n, reason) for reason, n in grown.items() if n), key=lambda x: (-x[0], x[1]))[:TOP_REASONS]
    if top:
        line += " (" + ", ".join(f"{reason} {n / seconds:.1f}/s" for n, reason in top) + ")"
    return line


def _tenant_line(before: dict[str, Any], t: dict[str, Any], seconds: float) -> str:
    cap = t.get("max_inflight") or 0
    guaranteed = t.get("guaranteed_inflight") or 0
    line = (
        f"  {t.get('name')} (weight {t.get('weight', 1.0):g}): "
        f"{t.get('inflight', 0)}{f'/{cap}' if cap else ''} in flight"
        f"{f' ({guaranteed} guaranteed)' if guaranteed else ''}, "
        f"admitted {_delta(before, t, 'admitted_total') / seconds:.1f}/s, "
        f"executed {_delta(before, t, 'executed_total') / seconds:.1f}/s, "
        f"{_yields(before, t, seconds)}, "
        f"settled {_delta(before, t, 'tokens_settled_total') / seconds:.0f} tokens/s"
    )
    if t.get("contending"):
        line += f", contending (lead {t.get('service_lead', 0.0):g})"
    return line


def _tenants_lines(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[str]:
    """The busiest tenants: by admitted rate over the interval, then in flight, then yield rate."""
    tenants: list[dict[str, Any]] = after.get("tenants") or []
    old = {t.get("name"): t for t in before.get("tenants") or []}

    def busiest(t: dict[str, Any]) -> tuple[float, int, float, str]:
        was = old.get(t.get("name"), {})
        admitted, yielded = _delta(was, t, "admitted_total"), _delta(was, t, "yielded_total")
        return (-admitted, -t.get("inflight", 0), -yielded, str(t.get("name")))

    ranked = sorted(tenants, key=busiest)
    share = after.get("tenant_share_from")
    details = ", ".join(
        part
        for part in (
            f"named by {after['tenant_from']}" if after.get("tenant_from") else "",
            f"fair shares past {share * 100:g}% of the caps" if share is not None else "",
        )
        if part
    )
    lines = [f"tenants: {len(tenants)}" + (f" ({details})" if details else "")]
    lines.extend(_tenant_line(old.get(t.get("name"), {}), t, seconds) for t in ranked[:TOP_TENANTS])
    if len(ranked) > TOP_TENANTS:
        lines.append(f"  +{len(ranked) - TOP_TENANTS} more")
    return lines


def _class_line(name: str, before: dict[str, Any], c: dict[str, Any], seconds: float) -> str:
    ceiling = c.get("ceiling")
    at = "" if ceiling is None else f"ceiling {ceiling * 100:g}%, "
    preempted = _delta(before, c, "preempted_total")
    return (
        f"  {name}: {at}{c.get('inflight', 0)} in flight, "
        f"admitted {_delta(before, c, 'admitted_total') / seconds:.1f}/s, {_yields(before, c, seconds)}"
        + (f", {preempted / seconds:.1f}/s displaced before a first token" if preempted else "")
    )


def _tenancy_lines(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[str]:
    """The busiest tenants and the priority classes that saw traffic since start, when there is
    more than the default tenant or a class other than standard saw traffic. Read with `.get`: a
    governor older than tenants has neither."""
    tenants: list[dict[str, Any]] = after.get("tenants") or []
    classes: dict[str, dict[str, Any]] = after.get("classes") or {}
    used = {
        name: c for name, c in classes.items() if c.get("admitted_total") or c.get("yielded_total") or c.get("inflight")
    }
    if len(tenants) <= 1 and not set(used) - {"standard"}:
        return []
    lines = _tenants_lines(before, after, seconds) if tenants else []
    if used:
        old = before.get("classes") or {}
        lines.append("priority classes:")
        lines.extend(_class_line(name, old.get(name, {}), c, seconds) for name, c in used.items())
    return lines


def _load_lines(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[str]:
    """Serving or draining, the cap and load, and the rates over the interval."""
    cap = f"{after['inflight']}/{after['max_inflight']} in flight"
    qps = f", --max-qps {after['max_qps']:g} ({after['qps_tokens']:g} tokens)" if after.get("max_qps") else ""
    state = "DRAINING" if after["draining"] else "serving"
    n = after["connections"]
    doors = after.get("connections_by_protocol", {})
    split = f" (ndjson {doors['ndjson']}, http {doors['http']})" if doors.get("http") else ""
    lines = [f"governor: {state}, {cap}{qps}, {n} connection{'s' if n != 1 else ''}{split}"]
    http = after.get("received_by_protocol", {}).get("http", 0)
    if http:
        lines.append(f"received through the HTTP front door since start: {http}")
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
    return lines


def _since_start_lines(after: dict[str, Any]) -> list[str]:
    """The yields, rejections, failures and shed connections since start by reason, and the
    service time observed."""
    lines = []
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
    return lines


def _worker_line(w: dict[str, Any], was: dict[str, Any], seconds: float) -> str:
    """One endpoint: up or down, its load and soft caps, its counts, and what its engine reports."""
    caps = (
        ", ".join(f"{name} {w[name]:g}" for name in ("concurrency", "tokens", "qps") if w.get(name)) or "no soft caps"
    )
    kind = f" [openai, model {w['model']}]" if w.get("kind") == "openai" else ""
    name = w.get("name") or w["address"]
    line = (
        f"  {'up  ' if w['up'] else 'DOWN'} {name}{kind}: {w['inflight']} in flight ({caps}), "
        f"executed {w['executed']}, failed {w['failed']}"
    )
    if w.get("busy"):
        line += f", busy (429/503) {w['busy']}"
    if not w["up"] and w.get("last_error"):
        line += f", last error: {w['last_error']}"
    probe = w.get("probe")
    if probe and probe.get("step_ms") is not None:
        line += f", probed {probe['step_ms']:g} ms/token" + (f" batch {probe['batch']}" if probe.get("batch") else "")
    elif probe:
        line += f", probe {probe['outcome']}: {probe.get('why') or 'no pace'}"
    engine = w.get("engine", {})
    tokens = _engine_rate(was.get("engine", {}), engine, "generated_tokens_total", seconds)
    if tokens is not None:
        line += f", {tokens:.0f} tok/s"
    if "running" in engine:
        line += f", running {engine['running']}, waiting {engine.get('waiting', 0)}"
    return line


def _workers_lines(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[str]:
    lines = [
        f"workers: {sum(w['up'] for w in after['workers'])}/{len(after['workers'])} up, "
        f"{after['worker_restarts']} restarts, {after['rerouted_total']} re-routed"
    ]
    previous = {w["address"]: w for w in before["workers"]}
    lines.extend(_worker_line(w, previous.get(w["address"], {}), seconds) for w in after["workers"])
    return lines


def render_status(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """Caps and load, rates over the interval, yields by reason, token budgets, deadlines and the
    adaptive limit when in use, the fleet lease with --fleet, the busiest tenants and the
    priority classes when there are more than one, and each endpoint's health. `before` and
    `after`: two `stats` replies (`Snapshot.to_dict`, maybe of an older governor's)."""
    lines = _load_lines(before, after, seconds)
    lines += _since_start_lines(after)
    lines += _hint_lines(before, after)
    lines += _token_lines(after)
    lines += _fleet_lines(after)
    lines += _tenancy_lines(before, after, seconds)
    lines += _workers_lines(before, after, seconds)
    return "\n".join(lines) + "\n"
