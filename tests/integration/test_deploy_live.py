"""Every metric the alert rules, the dashboard and the HPA's adapter rule query exists on a live governor.

A metric renamed in governor/metrics.py would otherwise leave deploy/ querying nothing, silently:
an alert on an absent series never fires. The governor runs the real GPT-2 engine (tiny random
weights) so that the worker's pushed statistics appear too, and joins a fleet on a real Redis so
that the fleet's series do.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.integration.conftest import Governor
from tests.redis_server import RedisServer
from tests.unit.test_deploy import promql_expressions, referenced_label_values, referenced_metrics

# The echo engine pushes only `running`; the GPT-2 engine pushes every governor_worker_* statistic.
TINY_GPT2 = (
    "--engine", "gpt2", "--model", "random-tiny", "--device", "cpu", "--threads", "1",
    "--kv-cache-tokens", "1024", "--max-batch-size", "4", "--stats-interval-s", "0.05",
)  # fmt: skip


def test_every_metric_deploy_queries_is_exported(
    start_governor: Callable[..., Governor], redis_server: RedisServer
) -> None:
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
