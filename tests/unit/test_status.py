"""`governor status` rendering from two stats snapshots."""

from __future__ import annotations

import copy
from typing import Any

from governor.adaptive_limit import AdaptiveMode, AdaptivePolicy
from governor.status import render_status
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
