from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from governor.admission.endpoint import Endpoint, EndpointLimits, OpenAITarget
from governor.latency import Histogram
from governor.links.upstream import Upstream
from governor.report.metrics import build_registry
from governor.state import ServerState
from govwire.address import Address
from govwire.codec import encode, generate_frame
from govwire.messages import EngineStats
from tests.fakes import make_ingress, make_state


def scrape(
    state: ServerState, upstream: Upstream | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(build_registry(state, upstream or Upstream([]))).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and abs(h.total - 2.65) < 1e-9


def test_exposition_parses_and_matches_the_counters() -> None:
    state = make_state(max_inflight=1)
    ingress, _ = make_ingress(state)
    ingress.receive_data(
        b"".join(encode(generate_frame(f"r{i}", "x", stop_on_eos=False)) for i in range(3)) + b"junk\n"
    )
    samples = scrape(state)
    assert samples[("governor_inflight", ())] == 1
    assert samples[("governor_max_inflight", ())] == 1
    assert samples[("governor_received_total", ())] == 4
    assert samples[("governor_executed_total", ())] == 0
    assert samples[("governor_yielded_total", (("reason", "inflight"),))] == 2
    assert samples[("governor_yielded_total", (("reason", "draining"),))] == 0
    assert samples[("governor_rejected_total", (("reason", "bad_json"),))] == 1
    assert samples[("governor_failed_total", (("reason", "worker_lost"),))] == 0
    assert samples[("governor_connections_shed_total", (("reason", "idle_timeout"),))] == 0
    assert samples[("governor_admission_decision_seconds_count", ())] == 3
    assert ("process_resident_memory_bytes", ()) in samples
    # whether the hints hold: every outcome series from the first scrape, at 0
    for reason in ("inflight", "tokens"):
        for outcome in ("on_time", "early", "late", "yielded_again", "never"):
            assert samples[("governor_retry_hint_outcome_total", (("outcome", outcome), ("reason", reason)))] == 0
    assert samples[("governor_appointments", (("reason", "inflight"),))] == 0  # nothing forecast yet: no booking
    # signed (negative buckets), so prometheus-client exports its buckets without _sum and _count
    assert samples[("governor_release_forecast_error_seconds_bucket", (("le", "+Inf"),))] == 0


def test_each_endpoint_is_exported_under_a_worker_label() -> None:
    state = make_state()
    upstream = Upstream(
        [
            (Address(path="/tmp/a.sock"), Endpoint("a", EndpointLimits(concurrency=3, qps=5.0), state.clock())),
            (Address(path="/tmp/b.sock"), Endpoint("b", EndpointLimits(), state.clock())),
        ]
    )
    links = upstream.links
    links[0].endpoint.up, links[0].endpoint.inflight, links[0].endpoint.executed = True, 2, 7
    links[1].endpoint.failed = 1
    upstream.worker_links[0].engine_stats = EngineStats(steps_total=5, running=2)
    samples = scrape(state, upstream)
    a, b = (("worker", "a"),), (("worker", "b"),)  # the endpoints' names
    assert (samples[("governor_endpoint_up", a)], samples[("governor_endpoint_up", b)]) == (1, 0)
    assert samples[("governor_endpoint_inflight", a)] == 2
    assert samples[("governor_endpoint_executed_total", a)] == 7
    assert samples[("governor_endpoint_failed_total", b)] == 1
    assert samples[("governor_endpoint_concurrency_limit", a)] == 3
    assert samples[("governor_endpoint_qps_limit", a)] == 5.0
    assert samples[("governor_endpoint_qps_tokens", a)] == 5.0  # a full bucket: burst defaults to qps
    assert ("governor_endpoint_qps_tokens", b) not in samples  # no qps cap, no bucket
    assert samples[("governor_worker_steps_total", a)] == 5 and samples[("governor_worker_running", a)] == 2
    assert ("governor_worker_steps_total", b) not in samples  # nothing pushed yet
    assert ("governor_worker_waiting", a) not in samples  # a field the worker did not report


# The labels the Prometheus Operator sets on every target of a ServiceMonitor (prometheus-operator
# pkg/prometheus/promcfg.go), plus Prometheus' own: a metric label of one of these names would be
# overwritten by the target's and renamed `exported_<name>`, so alerts and dashboards would read the
# wrong value (`endpoint="metrics"` for every worker of a pod).
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint"}


def test_no_exported_label_clashes_with_the_operators_target_labels() -> None:
    state = make_state()
    target = OpenAITarget("http://127.0.0.1:8000/v1", "m")
    upstream = Upstream(
        [
            (Address(path="/tmp/a.sock"), Endpoint("a", EndpointLimits(concurrency=3, qps=5.0), state.clock())),
            (target, Endpoint("b", EndpointLimits(), state.clock())),
        ]
    )
    upstream.worker_links[0].engine_stats = EngineStats(steps_total=5, running=2)
    text = generate_latest(build_registry(state, upstream)).decode()
    labelled = {
        (family.name, label)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for label in sample.labels
    }
    assert labelled and not {pair for pair in labelled if pair[1] in TARGET_LABELS}
    shipped = (DEPLOY / "prometheus" / "alerts.yml").read_text() + (
        DEPLOY / "grafana" / "governor-dashboard.json"
    ).read_text()
    assert "labels.endpoint" not in shipped and "{{endpoint}}" not in shipped and ", endpoint)" not in shipped
