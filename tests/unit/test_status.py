"""`governor status` rendering from two stats snapshots."""

from __future__ import annotations

import copy
from typing import Any

from governor.admission.adaptive_limit import AdaptiveMode, AdaptivePolicy
from governor.admission.tenant import TenantLimits
from governor.fleet.lease import FleetLease, FleetPolicy, LeaseReply
from governor.fleet.member import FleetMember
from governor.report.status import render_status
from govwire.vocab import Priority
from tests.fakes import make_state


def snapshot() -> dict[str, Any]:
    return {
        "inflight": 3,
        "max_inflight": 8,
        "max_qps": 0.0,
        "qps_tokens": None,
        "received_total": 100,
        "executed_total": 80,
        "yielded_total": 10,
        "rejected_total": 5,
        "failed_total": 2,
        "yielded_by_reason": {"inflight": 10, "qps": 0},
        "rejected_by_reason": {"integrity": 5},
        "failed_by_reason": {"worker_lost": 2},
        "connections_shed": {"idle_timeout": 0},
        "connections": 4,
        "draining": False,
        "service_time_ms": 120.0,
        "worker_restarts": 1,
        "rerouted_total": 0,
        "workers": [
            {
                "address": "unix:/tmp/w0.sock",
                "up": True,
                "inflight": 3,
                "concurrency": 4,
                "qps": 0.0,
                "executed": 80,
                "failed": 2,
                "engine": {"generated_tokens_total": 1000, "running": 3, "waiting": 1},
            },
            {"address": "127.0.0.1:7072", "up": False, "inflight": 0, "concurrency": 0, "qps": 2.5, "executed": 0,
             "failed": 0, "engine": {}},
        ],
    }  # fmt: skip


def test_rates_come_from_the_difference_of_the_two_snapshots() -> None:
    before = snapshot()
    after = copy.deepcopy(before)
    after["received_total"] += 40
    after["executed_total"] += 20
    after["yielded_total"] += 20
    after["yielded_by_reason"]["inflight"] += 20
    after["workers"][0]["engine"]["generated_tokens_total"] += 500
    text = render_status(before, after, 2.0)
    assert "governor: serving, 3/8 in flight, 4 connections" in text
    assert "received 20.0/s, executed 10.0/s, yielded 10.0/s, rejected 0.0/s, failed 0.0/s" in text
    assert "yield ratio: 50.0%" in text
    assert "yields since start: inflight 30\n" in text  # reasons at 0 are left out
    assert "workers: 1/2 up, 1 restarts" in text
    assert "up   unix:/tmp/w0.sock: 3 in flight (concurrency 4), executed 80, failed 2, 250 tok/s" in text
    assert "DOWN 127.0.0.1:7072: 0 in flight (qps 2.5)" in text


def test_a_worker_restart_does_not_show_negative_tokens() -> None:
    before = snapshot()
    after = copy.deepcopy(before)
    after["workers"][0]["engine"]["generated_tokens_total"] = 10  # counters restart with the worker
    assert ", 0 tok/s" in render_status(before, after, 1.0)


def test_token_budget_deadlines_and_adaptive_limit_show_only_when_in_use() -> None:
    before = snapshot()
    after = copy.deepcopy(before)
    after.update(
        {
            "max_inflight": 12,
            "configured_max_inflight": 32,
            "inflight_tokens": 1450,
            "max_inflight_tokens": 8192,
            "max_tokens_per_s": 500.0,
            "token_rate_tokens": 321.5,
            "deadlines": {"met": 95, "expired": 5},
            "adaptive_limit": {"mode": "enforce", "limit": 12, "knee": 9},
        }
    )
    text = render_status(before, after, 1.0)
    assert "governor: serving, 3/12 in flight" in text
    assert "token budget: 1450/8192 tokens in flight, --max-tokens-per-s 500 (321.5 in its bucket)\n" in text
    assert "deadlines since start: met 95, expired 5 (5.0% expired)\n" in text
    assert "adaptive limit (enforce): 12, knee 9, --max-inflight 32\n" in text

    after.update(
        {
            "max_inflight_tokens": 0,
            "token_rate_tokens": None,
            "adaptive_limit": {"mode": "shadow", "limit": 32, "knee": None},
        }
    )
    text = render_status(before, after, 1.0)
    assert "token budget: 1450 tokens in flight, --max-tokens-per-s 500\n" in text
    assert "adaptive limit (shadow): 32, knee not yet known, --max-inflight 32\n" in text

    after.update(
        {
            "max_tokens_per_s": 0.0,
            "deadlines": {"met": 0, "expired": 0},
            "adaptive_limit": {"mode": "off", "limit": 32, "knee": None},
        }
    )
    text = render_status(before, after, 1.0)
    assert "token budget" not in text and "deadlines" not in text and "adaptive limit" not in text


def test_stats_of_a_governor_without_token_fields_still_render() -> None:
    # snapshot() has none of the token, deadline and adaptive-limit fields, like an older governor.
    text = render_status(snapshot(), snapshot(), 1.0)
    assert "token budget" not in text and "deadlines" not in text and "adaptive limit" not in text
    assert "workers: 1/2 up" in text


def test_a_real_snapshot_renders_its_token_budget_and_adaptive_limit() -> None:
    # The keys render_status reads are the ones ServerState.snapshot() writes.
    state = make_state(
        max_inflight=8,
        max_inflight_tokens=4000,
        tokens_per_s=100.0,
        adaptive=AdaptivePolicy(mode=AdaptiveMode.SHADOW, ceiling=8),
    )
    state.accounting.deadlines["expired"] = 1
    snap = state.snapshot()
    text = render_status(snap, snap, 1.0)
    assert "token budget: 0/4000 tokens in flight, --max-tokens-per-s 100 (100 in its bucket)\n" in text
    assert "deadlines since start: met 0, expired 1 (100.0% expired)\n" in text
    assert "adaptive limit (shadow): 8, knee not yet known, --max-inflight 8\n" in text


def tenant(name: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name,
        "weight": 1.0,
        "max_inflight": 0,
        "max_qps": 0.0,
        "qps_burst": 0.0,
        "max_inflight_tokens": 0,
        "max_tokens_per_s": 0.0,
        "tokens_burst": 0.0,
        "inflight": 0,
        "inflight_tokens": 0,
        "admitted_total": 0,
        "executed_total": 0,
        "yielded_total": 0,
        "yielded_by_reason": {},
        "tokens_settled_total": 0,
        "contending": False,
        "service_lead": 0.0,
    }
    row.update(fields)
    return row


def priority_class(ceiling: float, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "ceiling": ceiling,
        "inflight": 0,
        "admitted_total": 0,
        "executed_total": 0,
        "yielded_total": 0,
        "yielded_by_reason": {},
        "tokens_settled_total": 0,
    }
    row.update(fields)
    return row


def with_tenancy(tenants: list[dict[str, Any]], **classes: dict[str, Any]) -> dict[str, Any]:
    snap = snapshot()
    snap.update(
        {
            "tenant_from": "auth",
            "tenant_share_from": 0.8,
            "tenants": tenants,
            "classes": {
                "critical": priority_class(1.0),
                "standard": priority_class(1.0),
                "sheddable": priority_class(1.0),
                **classes,
            },
        }
    )
    return snap


def test_tenants_and_classes_show_their_rates_over_the_interval() -> None:
    before = with_tenancy(
        [
            tenant("default"),
            tenant("acme", admitted_total=100, executed_total=90, yielded_total=10,
                   yielded_by_reason={"tenant_share": 10}, tokens_settled_total=5000),
            tenant("globex", yielded_total=4, yielded_by_reason={"tenant_inflight": 4}),
        ],
        critical=priority_class(1.0, admitted_total=10),
        standard=priority_class(0.95, admitted_total=90, yielded_total=14),
    )  # fmt: skip
    after = with_tenancy(
        [
            tenant("default"),
            tenant("acme", weight=2.0, max_inflight=4, guaranteed_inflight=2, inflight=3, admitted_total=124,
                   executed_total=112,
                   yielded_total=16, yielded_by_reason={"tenant_share": 13, "inflight": 2, "tenant_qps": 1},
                   tokens_settled_total=6660, contending=True, service_lead=120.5),
            tenant("globex", inflight=1, admitted_total=4, executed_total=2, yielded_total=12,
                   yielded_by_reason={"tenant_inflight": 12}, tokens_settled_total=100),
        ],
        critical=priority_class(1.0, inflight=1, admitted_total=14, yielded_total=2,
                                yielded_by_reason={"inflight": 2}),
        standard=priority_class(0.95, inflight=3, admitted_total=114, yielded_total=40, preempted_total=4,
                                yielded_by_reason={"tenant_share": 13, "tenant_inflight": 12, "inflight": 1}),
    )  # fmt: skip
    text = render_status(before, after, 2.0)
    assert (
        "tenants: 3 (named by auth, fair shares past 80% of the caps)\n"
        "  acme (weight 2): 3/4 in flight (2 guaranteed), admitted 12.0/s, executed 11.0/s,"
        " yielded 3.0/s (tenant_share 1.5/s, inflight 1.0/s, tenant_qps 0.5/s), settled 830 tokens/s,"
        " contending (lead 120.5)\n"
        "  globex (weight 1): 1 in flight, admitted 2.0/s, executed 1.0/s,"
        " yielded 4.0/s (tenant_inflight 4.0/s), settled 50 tokens/s\n"
        "  default (weight 1): 0 in flight, admitted 0.0/s, executed 0.0/s, yielded 0.0/s, settled 0 tokens/s\n"
        "priority classes:\n"
        "  critical: ceiling 100%, 1 in flight, admitted 2.0/s, yielded 1.0/s (inflight 1.0/s)\n"
        "  standard: ceiling 95%, 3 in flight, admitted 12.0/s,"
        " yielded 13.0/s (tenant_share 6.5/s, tenant_inflight 6.0/s, inflight 0.5/s),"
        " 2.0/s displaced before a first token\n"
        "workers:"
    ) in text
    assert "sheddable" not in text  # a class that saw no traffic has no line


def test_only_the_five_busiest_tenants_are_listed() -> None:
    before = with_tenancy([tenant(f"t{i}", admitted_total=100) for i in range(8)])
    after = with_tenancy([tenant(f"t{i}", admitted_total=100 + i, inflight=1 if i == 0 else 0) for i in range(8)])
    lines = render_status(before, after, 1.0).splitlines()
    start = lines.index("tenants: 8 (named by auth, fair shares past 80% of the caps)")
    listed = [line.split()[0] for line in lines[start + 1 : start + 6]]
    assert listed == ["t7", "t6", "t5", "t4", "t3"]  # by admitted rate over the interval
    assert lines[start + 6] == "  +3 more"
    assert lines[start + 7].startswith("workers:")  # no class saw traffic: no class lines

    # Equal admitted rates: the tenant holding more in flight comes first.
    after = with_tenancy([tenant(f"t{i}", admitted_total=100, inflight=i % 3) for i in range(8)])
    lines = render_status(before, after, 1.0).splitlines()
    assert [line.split()[0] for line in lines[start + 1 : start + 6]] == ["t2", "t5", "t1", "t4", "t7"]


def test_one_tenant_and_standard_traffic_only_add_no_lines() -> None:
    before = with_tenancy([tenant("default", admitted_total=10)], standard=priority_class(1.0, admitted_total=10))
    after = with_tenancy([tenant("default", admitted_total=30)], standard=priority_class(1.0, admitted_total=30))
    text = render_status(before, after, 1.0)
    assert "tenants" not in text and "priority classes" not in text
    assert text == render_status(snapshot(), snapshot(), 1.0)  # as a governor without tenants renders

    # Sheddable traffic alone is enough for the class lines (and the lone tenant is listed too).
    shed = priority_class(0.8, admitted_total=5, yielded_total=1, yielded_by_reason={"inflight": 1})
    after["classes"]["sheddable"] = shed
    text = render_status(before, after, 1.0)
    assert "  default (weight 1): 0 in flight, admitted 20.0/s" in text
    assert "  standard: ceiling 100%, 0 in flight, admitted 20.0/s, yielded 0.0/s\n" in text
    assert "  sheddable: ceiling 80%, 0 in flight, admitted 5.0/s, yielded 1.0/s (inflight 1.0/s)\n" in text


def test_stats_of_a_governor_without_tenant_fields_render_as_before() -> None:
    text = render_status(snapshot(), snapshot(), 1.0)
    assert "tenants" not in text and "priority classes" not in text
    assert "observed service time: 120.0 ms\nworkers: 1/2 up" in text  # nothing between them
    # A tenant new since the first snapshot (a reload) counts from 0; one whose counters went back
    # (reloaded away and back) shows no negative rate.
    before = with_tenancy([tenant("default"), tenant("acme", admitted_total=50)])
    after = with_tenancy([tenant("default"), tenant("acme", admitted_total=10), tenant("new", admitted_total=3)])
    text = render_status(before, after, 1.0)
    assert "  new (weight 1): 0 in flight, admitted 3.0/s" in text
    assert "  acme (weight 1): 0 in flight, admitted 0.0/s" in text


def test_a_real_snapshot_renders_its_tenants_and_classes() -> None:
    # The keys the tenant and class lines read are the ones ServerState.snapshot() writes.
    state = make_state(max_inflight=8, tenants={"acme": TenantLimits(weight=2.0, max_inflight=4)})
    before = state.snapshot()
    (acme,) = [t for t in state.admission.tenants if t.name == "acme"]
    acme.tally.admitted += 6
    acme.tally.yielded["tenant_inflight"] += 2
    state.accounting.classes[Priority.CRITICAL].admitted += 6
    text = render_status(before, state.snapshot(), 2.0)
    assert "tenants: 2 (named by auth, fair shares past 80% of the caps)\n" in text
    assert "  acme (weight 2): 0/4 in flight, admitted 3.0/s, executed 0.0/s," in text
    assert "yielded 1.0/s (tenant_inflight 1.0/s)" in text
    assert "  critical: ceiling 100%, 6 in flight, admitted 3.0/s, yielded 0.0/s\n" in text


def test_a_real_snapshot_renders_the_fleet_lease() -> None:
    # The keys the fleet lines read are the ones the snapshot's FleetReading.to_dict writes into stats.
    state = make_state(max_inflight=8)
    assert "fleet" not in render_status(state.snapshot(), state.snapshot(), 1.0)
    lease = FleetLease(FleetPolicy(max_inflight=64, max_qps=300.0, hold_s=2.0), state.admission.hints, 0.0)
    clock = [0.5]
    state.fleet = FleetMember(
        "redis://:secret@redis:6379/0", "inference", lease, member_id="pod-a", clock=lambda: clock[0]
    )
    shares = (20.0, 90.0, 0, 0)
    lease.apply(
        LeaseReply(3, 1, 1, shares, (64, 300, 0, 0), (50, 250, 0, 0), (70, 400, 0, 0), shares, (40, 200, 0, 0)),
        0.0,
        0.001,
    )
    text = render_status(state.snapshot(), state.snapshot(), 1.0)
    head = "fleet inference:leases:v2 at redis://:***@redis:6379/0: DOWN (no lease renewed), leased, 3 replicas,"
    assert head in text
    assert "renewed 500 ms ago; 1 lapsed replica(s) still reserved\n" in text
    assert "  inflight: share 20 of 64, using 0; fleet using 50, wanting 70, granted 60\n" in text
    assert "  qps: share 90 of 300, using 0; fleet using 250, wanting 400, granted 290\n" in text
    clock[0] = 1.5
    lease.lapse(1.5)
    text = render_status(state.snapshot(), state.snapshot(), 1.0)
    assert (
        "holding, 3 replicas, renewal 1.0 ms, renewed 1500 ms ago (lapsed: --fleet-unavailable hold, now holding)"
        in text
    )
    lease.lapse(3.5)
    text = render_status(state.snapshot(), state.snapshot(), 1.0)
    assert "(lapsed: --fleet-unavailable hold, now closed)" in text


def test_retry_hint_outcomes_show_over_the_interval_only_when_clients_came_back() -> None:
    before = snapshot()
    assert "retry hints" not in render_status(before, copy.deepcopy(before), 1.0)  # an older governor
    before["retry_hints"] = {"outcomes": {"inflight": {"on_time": 10, "never": 3}}, "forecast_relative_error_p50": 0.1}
    after = copy.deepcopy(before)
    assert "retry hints" not in render_status(before, after, 1.0)  # nobody came back meanwhile
    after["retry_hints"] = {
        "outcomes": {"inflight": {"on_time": 28, "yielded_again": 2, "never": 5}},
        "forecast_relative_error_p50": 0.05,
    }
    text = render_status(before, after, 1.0)
    assert "retry hints (inflight): never 2, on_time 18, yielded_again 2; 10.0% of returns refused again" in text
    assert "release forecast: median error 5.0% of a service time" in text


def test_backfills_show_over_the_interval_only_when_some_were_made() -> None:
    before = snapshot()
    before["retry_hints"] = {"outcomes": {}, "backfilled_total": 4}
    after = copy.deepcopy(before)
    assert "backfilled" not in render_status(before, after, 1.0)
    after["retry_hints"]["backfilled_total"] = 7
    assert "backfilled: 3 admitted into slots kept for appointments due after they end" in render_status(
        before, after, 1.0
    )
