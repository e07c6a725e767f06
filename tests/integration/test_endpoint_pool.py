"""Three real echo workers behind one governor: endpoint caps, the global cap over them, re-routing."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Governor, Worker

pytestmark = pytest.mark.integration


def test_load_follows_the_caps_the_global_cap_holds_and_a_dead_endpoint_is_routed_around(
    start_worker: Callable[..., Worker], start_governor: Callable[..., Governor]
) -> None:
    # Each request holds its slot ~2 s (token delay) so that every admission is visible at once.
    workers = [start_worker("--engine", "echo", "--token-delay-ms", "1000") for _ in range(3)]
    caps = (1, 2, 4)
    endpoints = [f"{w.address},concurrency={cap}" for w, cap in zip(workers, caps, strict=True)]
    gov = start_governor(*(x for e in endpoints for x in ("--worker", e)), "--max-inflight", "5")
    gov.wait_until(lambda: all(w["up"] for w in gov.stats()["workers"]), what="all endpoints linked")
    c = gov.conn()
    for i in range(9):
        c.send(f"r{i}", "ab", max_new_tokens=2, stop_on_eos=False)
    yields = [c.until_final(f"r{i}")[-1] for i in range(5, 9)]
    assert [y["status"] for y in yields] == ["yield"] * 4
    assert {y["reason"] for y in yields} == {"inflight"}  # the global cap (5) binds before the endpoints' (7)
    stats = gov.stats()
    assert [w["inflight"] for w in stats["workers"]] == [1, 2, 2]  # 1/1, 2/2, 2/4: least loaded relative to cap
    finals = c.finals(5)
    assert all(f["status"] == "done" for f in finals.values())

    # Endpoint caps bind when they are below the global one.
    gov2 = start_governor("--worker", endpoints[0], "--worker", endpoints[1], "--max-inflight", "10")
    gov2.wait_until(lambda: all(w["up"] for w in gov2.stats()["workers"]), what="both endpoints linked")
    c2 = gov2.conn()
    for i in range(4):
        c2.send(f"s{i}", "ab", max_new_tokens=2, stop_on_eos=False)
    assert c2.until_final("s3")[-1]["reason"] == "endpoint_inflight"
    c2.finals(3)

    # A dead endpoint: its capacity stops counting and new work goes to the others, nothing lost.
    os.kill(workers[2].proc.pid, signal.SIGKILL)
    gov.wait_until(lambda: not gov.stats()["workers"][2]["up"], what="endpoint marked down")
    for i in range(4):
        c.send(f"t{i}", "ab", max_new_tokens=2, stop_on_eos=False)
    finals = c.finals(4)
    statuses = sorted(f.get("reason") or f["status"] for f in finals.values())
    assert statuses == ["done", "done", "done", "endpoint_inflight"]  # 1 + 2 slots left
    stats = gov.stats()
    assert stats["workers"][2]["executed"] == 2 and stats["executed_total"] == 8
    assert stats["received_total"] == stats["executed_total"] + stats["yielded_total"] + stats["failed_total"]
    metrics = gov.metrics()
    assert metrics[("governor_endpoint_executed_total", (("worker", workers[2].address),))] == 2
    assert metrics[("governor_endpoint_up", (("worker", workers[2].address),))] == 0
    assert metrics[("governor_yielded_total", (("reason", "endpoint_inflight"),))] == 1


def test_sighup_rereads_the_config_file_and_changes_caps_without_dropping_anything(
    start_worker: Callable[..., Worker], start_governor: Callable[..., Governor], tmp_path: Path
) -> None:
    worker = start_worker("--engine", "echo", "--token-delay-ms", "1500")  # each request holds ~3 s
    config = tmp_path / "governor.toml"
    body = '[[endpoint]]\naddress = "{}"\nconcurrency = {}\n'
    config.write_text("max_inflight = 1\n" + body.format(worker.address, 8))
    gov = start_governor("--config", str(config))
    c = gov.conn()
    c.send("a", "ab", max_new_tokens=3, stop_on_eos=False)
    c.send("b", "ab", max_new_tokens=3, stop_on_eos=False)
    assert c.until_final("b")[-1]["reason"] == "inflight"

    config.write_text("max_inflight = 4\n" + body.format(worker.address, 2))
    gov.proc.send_signal(signal.SIGHUP)
    gov.wait_until(lambda: gov.stats()["max_inflight"] == 4, what="reload")
    assert gov.stats()["workers"][0]["concurrency"] == 2
    c.send("c", "ab", max_new_tokens=3, stop_on_eos=False)
    c.send("d", "ab", max_new_tokens=3, stop_on_eos=False)
    assert c.until_final("d")[-1]["reason"] == "endpoint_inflight"  # a and c hold the endpoint's 2

    config.write_text("max_inflight = 1\n" + body.format(worker.address, 8))
    gov.proc.send_signal(signal.SIGHUP)
    gov.wait_until(lambda: gov.stats()["max_inflight"] == 1, what="second reload")
    c.send("e", "ab", max_new_tokens=3, stop_on_eos=False)
    assert c.until_final("e")[-1]["reason"] == "inflight"  # 2 running over the new cap of 1
    finals = c.finals(2)
    assert {f["status"] for f in finals.values()} == {"done"}  # lowering the cap cancelled nothing


def test_workers_n_spawns_n_local_workers_and_spreads_the_load(start_governor: Callable[..., Governor]) -> None:
    gov = start_governor("--workers", "2", "--max-inflight", "8", worker_args=("--token-delay-ms", "500"))
    gov.wait_until(lambda: all(w["up"] for w in gov.stats()["workers"]), what="both workers linked")
    workers = gov.stats()["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    c = gov.conn()
    for i in range(4):
        c.send(f"r{i}", "ab", max_new_tokens=2, stop_on_eos=False)
    gov.wait_until(lambda: gov.stats()["inflight"] == 4, what="all admitted")
    assert [w["inflight"] for w in gov.stats()["workers"]] == [2, 2]
    assert all(f["status"] == "done" for f in c.finals(4).values())


def test_requests_not_started_on_a_lost_endpoint_are_rerouted_once(
    start_worker: Callable[..., Worker], start_governor: Callable[..., Governor]
) -> None:
    slow = ("--engine", "echo", "--first-token-delay-ms", "1500")
    doomed, spare = start_worker(*slow), start_worker(*slow)
    gov = start_governor("--worker", doomed.address, "--worker", spare.address)
    gov.wait_until(lambda: all(w["up"] for w in gov.stats()["workers"]), what="both endpoints linked")
    c = gov.conn()
    for i in range(4):
        c.send(f"r{i}", "ab", max_new_tokens=2, stop_on_eos=False)
    gov.wait_until(lambda: [w["inflight"] for w in gov.stats()["workers"]] == [2, 2], what="spread")
    os.kill(doomed.proc.pid, signal.SIGKILL)  # before any first token
    finals = c.finals(4)
    assert {f["status"] for f in finals.values()} == {"done"}  # nobody saw the loss
    stats = gov.stats()
    assert stats["rerouted_total"] == 2 and stats["executed_total"] == 4 and stats["failed_total"] == 0
    assert stats["workers"][1]["executed"] == 4 and stats["workers"][0]["failed"] == 2


def test_a_hung_endpoint_is_cut_by_its_ping_timeout_and_readded_once_it_answers(
    start_worker: Callable[..., Worker], start_governor: Callable[..., Governor]
) -> None:
    hung, healthy = start_worker("--engine", "echo", "--token-delay-ms", "100"), start_worker("--engine", "echo")
    ping = ("--worker-ping-interval-s", "0.1", "--worker-ping-timeout-s", "0.5")
    gov = start_governor("--worker", hung.address, "--worker", healthy.address, *ping)
    gov.wait_until(lambda: all(w["up"] for w in gov.stats()["workers"]), what="both endpoints answer pings")
    c = gov.conn()
    c.send("long", "ab", max_new_tokens=100, stop_on_eos=False)  # the round-robin start: endpoint 0
    assert c.recv()["status"] == "token"
    os.kill(hung.proc.pid, signal.SIGSTOP)  # alive and connected, but it answers nothing
    try:
        stopped = time.monotonic()
        final = c.until_final("long")[-1]
        assert final["status"] == "error" and final["code"] == "worker_lost"
        assert time.monotonic() - stopped < 2.0  # timeout 0.5 s + one ping interval, with slack
        workers = gov.stats()["workers"]
        assert not workers[0]["up"] and workers[1]["up"]
        for i in range(3):
            c.send(f"r{i}", "ab", max_new_tokens=2, stop_on_eos=False)
        assert {f["status"] for f in c.finals(3).values()} == {"done"}
        assert gov.stats()["workers"][1]["executed"] == 3
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    gov.wait_until(lambda: gov.stats()["workers"][0]["up"], what="the endpoint answers again")
    stats = gov.stats()
    assert stats["received_total"] == stats["executed_total"] + stats["failed_total"] == 4
