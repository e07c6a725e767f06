"""`governor status` rendering from two stats snapshots."""

from __future__ import annotations

import copy
from typing import Any

from governor.status import render_status


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
