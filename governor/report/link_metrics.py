"""Prometheus families of what the links know: each endpoint's soft layer, the statistics its
worker pushes, and the gauges a GAIE endpoint picker reads from a vLLM pod.

Read from the links themselves at scrape time (the snapshot's layer sits below them and sees
them only through their `stats` description); metrics.py yields these among its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from governor.links.openai_link import OpenAILink
from governor.links.upstream import Upstream
from governor.links.worker_link import WorkerLink
from govwire.messages import STATS_HELP

Family = GaugeMetricFamily | CounterMetricFamily

# key -> (counter?, name, help): one sample per endpoint, labelled with its name (`worker`).
_ENDPOINT_FAMILIES: dict[str, tuple[bool, str, str]] = {
    "up": (False, "governor_endpoint_up", "1 while the endpoint answers pings."),
    "inflight": (False, "governor_endpoint_inflight", "Admitted requests without a final reply."),
    "executed": (True, "governor_endpoint_executed", "Requests the endpoint completed with done."),
    "failed": (
        True,
        "governor_endpoint_failed",
        "Requests that failed on the endpoint: lost with it, or an error it sent (not a client's 4xx,"
        " disconnect or deadline).",
    ),
    "concurrency": (False, "governor_endpoint_concurrency_limit", "The endpoint's concurrency cap; 0 = none."),
    "qps": (False, "governor_endpoint_qps_limit", "The endpoint's admissions-per-second cap; 0 = none."),
    "tokens": (False, "governor_endpoint_qps_tokens", "Admissions the endpoint's qps bucket holds now."),
    "inflight_tokens": (
        False,
        "governor_endpoint_inflight_tokens",
        "Token cost held by the endpoint's admitted, unfinished requests.",
    ),
    "tokens_limit": (False, "governor_endpoint_tokens_limit", "The endpoint's token budget (tokens=N); 0 = none."),
    "info": (
        False,
        "governor_endpoint_info",
        "1 per endpoint, labelled with its kind (worker: NDJSON worker process; openai: an "
        "OpenAI-compatible HTTP server) and the model it is asked for.",
    ),
    "busy": (
        True,
        "governor_endpoint_busy",
        "429/503 answers of an OpenAI-compatible endpoint (it was paused for its Retry-After).",
    ),
    "waiting": (
        False,
        "governor_endpoint_waiting",
        "The endpoint's admitted requests without a first token yet (what the TTFT prediction waits behind).",
    ),
}


def worker_stats_families(links: Sequence[WorkerLink]) -> Iterator[Family]:
    """The workers' pushed statistics (govwire.messages.EngineStats), one sample per endpoint: a
    field ending in `_total` is a counter (restarting at 0 with its worker), the rest are gauges."""
    for key, help_text in STATS_HELP.items():
        samples = [
            (link.endpoint.name, value) for link in links if (value := getattr(link.engine_stats, key)) is not None
        ]
        if not samples:
            continue
        family: Family
        if key.endswith("_total"):
            family = CounterMetricFamily(f"governor_worker_{key[:-6]}", help_text, labels=["worker"])
        else:
            family = GaugeMetricFamily(f"governor_worker_{key}", help_text, labels=["worker"])
        for address, value in samples:
            family.add_metric([address], value)
        yield family


def endpoint_families(upstream: Upstream, now: float) -> Iterator[Family]:
    """The pool's soft layer, one sample per endpoint (its worker address)."""
    families: dict[str, Family] = {
        key: (CounterMetricFamily if counter else GaugeMetricFamily)(
            name, help_text, labels=["worker", "kind", "model"] if key == "info" else ["worker"]
        )
        for key, (counter, name, help_text) in _ENDPOINT_FAMILIES.items()
    }
    probes = CounterMetricFamily(
        "governor_endpoint_probes",
        "Probes of an OpenAI-compatible endpoint as it came up (a few short streamed completions), by outcome:"
        " ok, failed (an error, no stream), timeout (abandoned, what streamed by then kept).",
        labels=["worker", "outcome"],
    )
    probed = GaugeMetricFamily(
        "governor_endpoint_probed_step_seconds",
        "The time between two tokens an endpoint's last probe measured: the forecast's prior for it until its"
        " streams say more.",
        labels=["worker"],
    )
    for link in upstream.links:
        e = link.endpoint
        label = [link.endpoint.name]  # its address, or `spawned-N`: stable across restarts
        if isinstance(link, OpenAILink) and link.target.probe:
            for outcome, count in link.probes.items():
                probes.add_metric([e.name, outcome], count)
            if e.probed is not None and e.probed.step_s is not None:
                probed.add_metric(label, e.probed.step_s)
        families["up"].add_metric(label, int(e.up))
        model = link.target.model if isinstance(link, OpenAILink) else ""
        families["info"].add_metric([link.endpoint.name, link.kind, model], 1)
        if isinstance(link, OpenAILink):
            families["busy"].add_metric(label, link.busy_total)
        families["inflight"].add_metric(label, e.inflight)
        families["executed"].add_metric(label, e.executed)
        families["failed"].add_metric(label, e.failed)
        families["concurrency"].add_metric(label, e.limits.concurrency)
        families["qps"].add_metric(label, e.limits.qps)
        if e.bucket is not None:
            families["tokens"].add_metric(label, e.bucket.level(now))
        families["inflight_tokens"].add_metric(label, e.tokens)
        families["tokens_limit"].add_metric(label, e.limits.tokens)
        families["waiting"].add_metric(label, e.waiting)
    yield from families.values()
    yield probes
    yield probed


def model_server_families(held: int, upstream: Upstream, served_model: str) -> Iterator[GaugeMetricFamily]:
    """The gauges a Gateway API Inference Extension endpoint picker scrapes from a vLLM pod, as the
    governor sees them, one series per model the front door serves (vLLM's `model_name` label):
    running = its endpoints' admitted, unfinished requests; waiting = the returning clients held
    in the lobby (`held`: nothing else waits here, a refusal is an answer); the KV cache's use =
    the mean of what its governor workers report, left out for a model no worker serves (an
    OpenAI-compatible server exports its own)."""
    running = GaugeMetricFamily(
        "vllm:num_requests_running",
        "Requests admitted by the governor and not finished, per served model (GAIE model-server protocol).",
        labels=["model_name"],
    )
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Requests held in the governor's lobby for their appointment (nothing else waits), per served model.",
        labels=["model_name"],
    )
    kv = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc",
        "Mean share (0-1) of the KV cache in use over the governor's workers serving the model.",
        labels=["model_name"],
    )
    by_model: dict[str, list[WorkerLink | OpenAILink]] = {}
    for link in upstream.links:
        name = link.target.served_name if isinstance(link, OpenAILink) else served_model
        by_model.setdefault(name, []).append(link)
    for name, links in by_model.items():
        running.add_metric([name], sum(link.endpoint.inflight for link in links))
        waiting.add_metric([name], held)
        usage = [
            ratio
            for link in links
            if isinstance(link, WorkerLink) and (ratio := link.engine_stats.kv_cache_usage_ratio) is not None
        ]
        if usage:
            kv.add_metric([name], sum(usage) / len(usage))
    yield from (running, waiting, kv)
