"""deploy/'s queries against a live governor: every metric the alert rules, the dashboard and the
HPA's adapter rules name is exported, a real Prometheus evaluates them all (scraping as the shipped
prometheus.yml does and as the Prometheus Operator does for the ServiceMonitor), and promtool
accepts the exposition.

A metric renamed in governor/report/metrics.py would otherwise leave deploy/ querying nothing, silently:
an alert on an absent series never fires. The governor runs the real GPT-2 engine (tiny random
weights) so that the worker's pushed statistics appear too, and joins a fleet on a real Redis so
that the fleet's series do.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.fixtures.redis_server import RedisServer
from tests.deploy_tools import tool
from tests.integration.conftest import Governor
from tests.prometheus_server import PrometheusError, PrometheusServer
from tests.unit.test_deploy import DEPLOY, K8S, promql_expressions, referenced_label_values, referenced_metrics

# The echo engine pushes only `running`; the GPT-2 engine pushes every governor_worker_* statistic.
TINY_GPT2 = (
    "--engine", "gpt2", "--model", "random-tiny", "--device", "cpu", "--threads", "1",
    "--kv-cache-tokens", "1024", "--max-batch-size", "4", "--stats-interval-s", "0.05",
)  # fmt: skip


def _served_governor(start_governor: Callable[..., Governor], redis_server: RedisServer) -> Governor:
    """A GPT-2 governor in a fleet that has served requests and pushed its engine statistics."""
    fleet = ("--fleet", redis_server.url, "--fleet-max-inflight", "64", "--fleet-max-qps", "1000")
    governor = start_governor(*fleet, worker_args=TINY_GPT2)
    conn = governor.conn()
    for i in range(3):  # requests so the latency histograms and engine counters have moved
        conn.send(f"r{i}", "hello", max_new_tokens=4)
    assert {r["status"] for r in conn.finals(3).values()} == {"done"}

    def generated() -> bool:
        return any(
            v > 0 for (name, _), v in governor.metrics().items() if name == "governor_worker_generated_tokens_total"
        )

    governor.wait_until(generated, what="the worker's pushed statistics")
    return governor


def test_every_metric_deploy_queries_is_exported(
    start_governor: Callable[..., Governor], redis_server: RedisServer
) -> None:
    governor = _served_governor(start_governor, redis_server)
    samples = governor.metrics()
    exported = {name for name, _ in samples}
    label_values = {(name, label, value) for name, labels in samples for label, value in labels}
    missing: dict[str, set[str]] = {}
    for where, expr in promql_expressions().items():
        absent = {m for m in referenced_metrics(expr) if m not in exported}
        absent |= {f"{m}{{{label}={value!r}}}" for m, label, value in referenced_label_values(expr)} - {
            f"{m}{{{label}={value!r}}}" for m, label, value in label_values
        }
        if absent:
            missing[where] = absent
    assert not missing, f"deploy/ queries series the governor does not export: {missing}"


# What the Prometheus Operator puts on a ServiceMonitor's targets (prometheus-operator
# pkg/prometheus/promcfg.go): these become target labels, and a metric label of the same name is
# renamed exported_<name> unless honorLabels is set. The pod is the one the adapter rules select.
POD = "inference-7d9f-abcde"


def operator_scrape_config(target: str) -> dict[str, Any]:
    """The scrape job the operator generates for deploy/k8s/servicemonitor.yaml, with a static
    target standing in for its Kubernetes service discovery."""
    monitor = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["endpoints"]
    # What this stand-in does not translate (the operator's camelCase relabelling) must be absent.
    assert set(endpoint) <= {"port", "path", "interval", "honorLabels"}, endpoint
    target_labels = {
        "namespace": "default",
        "service": "governor-metrics",
        "pod": POD,
        "container": "governor",
        "endpoint": endpoint["port"],
    }
    return {
        "job_name": f"serviceMonitor/default/{monitor['metadata']['name']}/0",
        "honor_labels": endpoint.get("honorLabels", False),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scrape_interval": "1s",  # the monitor's own interval, shortened so the test is quick
        "static_configs": [{"targets": [target], "labels": target_labels}],
    }


def shipped_scrape_config(target: str) -> tuple[dict[str, Any], list[str]]:
    """deploy/prometheus.yml's job pointed at `target`, and its rule files as absolute paths."""
    shipped = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = shipped["scrape_configs"]
    job = {**job, "scrape_interval": "1s", "static_configs": [{"targets": [target]}]}
    return job, [str(DEPLOY / path) for path in shipped["rule_files"]]


def as_queried(where: str, expr: str, target: str) -> str:
    """The expression as Grafana or prometheus-adapter would send it for this target and pod."""
    expr = expr.replace("$instance", target).replace("$__rate_interval", "1m")
    expr = expr.replace("<<.LabelMatchers>>", f'namespace="default",pod="{POD}"').replace("<<.GroupBy>>", "pod")
    if expr.startswith("label_values("):  # a Grafana variable query: the series it lists values of
        expr = expr.removeprefix("label_values(").rpartition(",")[0]
    return expr


THRESHOLD = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*[0-9.e+-]+\s*$")


def without_threshold(expr: str) -> str:
    """`expr` without a final comparison with a number (`... > 0`): the value it filters."""
    return THRESHOLD.sub("", expr.strip())


def test_a_live_prometheus_evaluates_every_deploy_query_and_the_operator_keeps_the_worker_label(
    start_governor: Callable[..., Governor], redis_server: RedisServer, tmp_path: Path
) -> None:
    promtool, _ = tool("promtool"), tool("prometheus")  # skip before starting anything
    governor = _served_governor(start_governor, redis_server)
    target = f"127.0.0.1:{governor.metrics_port}"

    # promtool's lint of the exposition itself (metric names, help, units, counters' _total).
    _, exposition = governor.http("/metrics")
    lint = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=30)
    # The GAIE model-server protocol names its gauges as vLLM does (`vllm:num_requests_running`):
    # the lint's "no ':' outside recording rules" convention is the one finding they may have
    # (vLLM's own exposition has it too); anything else about them, or any other finding, fails.
    protocol_names = re.compile(r"^vllm:\w+ metric names should not contain ':'$")
    lines = [line.strip() for line in (lint.stdout + lint.stderr).splitlines() if line.strip()]
    assert not [line for line in lines if not protocol_names.match(line)], lint.stdout + lint.stderr
    assert lint.returncode == 0 or lines  # a failing exit only for that finding

    shipped_job, rule_files = shipped_scrape_config(target)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": rule_files,
        "scrape_configs": [shipped_job, operator_scrape_config(target)],
    }
    prometheus = PrometheusServer(config, tmp_path)
    try:
        prometheus.start()
        # Enough scrapes of both jobs for rate() over the dashboard's 1m, and every rule evaluated.
        prometheus.wait_until(
            lambda: len(prometheus.query("count_over_time(up[1m]) >= 4 and up == 1")) == 2, 60, "two healthy targets"
        )

        def rules_evaluated() -> bool:
            rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            return bool(rules) and all(not r["lastEvaluation"].startswith("0001") for r in rules)

        prometheus.wait_until(rules_evaluated, 30, "every alert rule evaluated")
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        shipped_alerts = [k.partition(":")[2] for k in promql_expressions() if k.startswith("alerts.yml")]
        assert sorted(r["name"] for r in rules) == sorted(shipped_alerts)
        unhealthy = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
        assert not unhealthy, unhealthy

        errors: dict[str, str] = {}
        empty: list[str] = []
        for where, expr in promql_expressions().items():
            # An alert's condition may well be false now, and a panel may filter to what is above
            # zero; the value they compare with a number must have data all the same. (An alert
            # whose comparisons are inside it is only evaluated.)
            value = without_threshold(expr)
            must_show_data = not where.startswith("alerts.yml") or value != expr.strip()
            try:
                prometheus.query(as_queried(where, expr, target))
                result = prometheus.query(as_queried(where, value, target))
            except PrometheusError as exc:
                errors[where] = str(exc)
                continue
            if must_show_data and not result:
                empty.append(f"{where}: {value}")
        assert not errors, errors
        assert not empty, "queries that return nothing on a governor that has served:\n" + "\n".join(empty)

        # The operator's target labels must not displace the governor's own: no exported_* label,
        # and the per-worker series keep one `worker` label each, as the plain scrape has them.
        operator = 'job=~"serviceMonitor/.*"'
        series = prometheus.api("series", **{"match[]": f'{{__name__=~"governor_.+",{operator}}}'})
        assert series
        renamed = sorted({label for s in series for label in s if label.startswith("exported_")})
        assert not renamed, f"labels the operator's target labels displaced: {renamed}"
        assert {s["endpoint"] for s in series} == {"metrics"}
        up = prometheus.query(f"governor_endpoint_up{{{operator}}}")
        plain = prometheus.query(f'governor_endpoint_up{{job="{shipped_job["job_name"]}"}}')
        assert sorted(s["metric"]["worker"] for s in up) == sorted(s["metric"]["worker"] for s in plain) != []
        by_worker = prometheus.query(f"sum by (instance, worker) (governor_endpoint_up{{{operator}}})")
        assert len(by_worker) == len(up)
    finally:
        prometheus.stop()
