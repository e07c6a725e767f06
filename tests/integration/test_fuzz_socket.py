"""The raw-byte fuzzer (benchmarks/robustness/fuzz.py) for a few seconds against a real governor and echo worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from benchmarks.robustness.fuzz import GOVERNOR_FLAGS, WORKER_ARGS, check_server, fuzz, summary
from tests.integration.conftest import Governor

pytestmark = pytest.mark.integration


def test_hostile_bytes_leave_the_counters_balanced_and_the_server_serving(
    start_governor: Callable[..., Governor],
) -> None:
    gov = start_governor(*GOVERNOR_FLAGS, worker_args=WORKER_ARGS)
    report = asyncio.run(fuzz(gov.port, seed=6, seconds=3.0, connections=4))
    snapshot = check_server(gov.port, report, lambda: gov.proc.poll() is None)
    assert not report.failures, summary(report, snapshot)
    # The mix reached every outcome the fuzzer is there to provoke, so the checks above mean something.
    assert snapshot["inflight"] == 0 and snapshot["executed_total"] > 0 and snapshot["yielded_total"] > 0
    for code in ("bad_json", "bad_frame", "frame_too_large", "duplicate_id"):
        assert snapshot["rejected_by_reason"][code] > 0, code
    assert snapshot["failed_by_reason"]["client_disconnected"] > 0
    assert report.closes["drain"] > 0 and report.lines_drained > 0
    c = gov.conn()
    c.send("after", "ok", max_new_tokens=8)
    assert c.until_final("after")[-1]["text"] == "ok"
    assert gov.proc.poll() is None
