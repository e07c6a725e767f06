from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from governor.metrics import Histogram, build_registry
from governor.wire import encode, generate_frame
from tests.fakes import make_ingress, make_state


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and abs(h.total - 2.65) < 1e-9


def test_exposition_parses_and_matches_the_counters() -> None:
    state = make_state(max_inflight=1)
    ingress, _ = make_ingress(state)
    ingress.receive_data(b"".join(encode(generate_frame(f"r{i}", "x")) for i in range(3)) + b"junk\n")
    text = generate_latest(build_registry(state)).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("governor_inflight", ())] == 1
    assert samples[("governor_max_inflight", ())] == 1
    assert samples[("governor_received_total", ())] == 4
    assert samples[("governor_executed_total", ())] == 0
    assert samples[("governor_yielded_total", (("reason", "inflight"),))] == 2
    assert samples[("governor_yielded_total", (("reason", "draining"),))] == 0
    assert samples[("governor_rejected_total", (("reason", "bad_json"),))] == 1
    assert samples[("governor_failed_total", (("reason", "worker_lost"),))] == 0
    assert samples[("governor_admission_decision_seconds_count", ())] == 3
    assert "process_resident_memory_bytes" in text
