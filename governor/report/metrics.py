"""Prometheus exposition of the governor's own counters.

The hot path only bumps plain ints (see accounting.py) and `Histogram.observe` (a bisect and two
adds); prometheus-client's own Counter/Histogram take a lock per call, which the yield path cannot
afford. A custom collector turns the plain values into metric families at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from governor.admission.adaptive_limit import AdaptiveMode
from governor.admission.appointments.registry import OUTCOMES
from governor.admission.tally import Tally
from governor.fleet.lease import RESOURCES, FleetState
from governor.fleet.member import FleetMember
from governor.latency import HINT_BUCKETS, Histogram
from governor.links.openai_link import OpenAILink
from governor.links.upstream import Upstream
from governor.links.worker_link import WorkerLink
from governor.state import ServerState
from govwire.messages import STATS_HELP
from govwire.vocab import Priority, YieldReason

_NO_HINTS = Histogram(HINT_BUCKETS)  # a reason that has handed out no hint yet

_HISTOGRAM_HELP = {
    "admission_decision": (
        "Time from the start of the read that completed a generate frame to the read's last admit or yield"
        " decision: an upper bound of each frame's, one sample per frame."
    ),
    "queue_wait": "Time an admitted request waited inside the worker before its prefill started.",
    "time_to_first_token": "Time from an admitted frame to its first token, measured at the governor.",
    "request_duration": "Time from frame arrival to the final reply, for requests dispatched to a worker.",
    "event_loop_lag": (
        "How late the event loop ran a timer (sampled every 50 ms): the longest a ready read, token or"
        " timer waited behind the work of the turn before it."
    ),
}


def _worker_stats_families(links: Sequence[WorkerLink]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The workers' pushed statistics (govwire.messages.EngineStats), one sample per endpoint: a
    field ending in `_total` is a counter (restarting at 0 with its worker), the rest are gauges."""
    for key, help_text in STATS_HELP.items():
        samples = [
            (link.endpoint.name, value) for link in links if (value := getattr(link.engine_stats, key)) is not None
        ]
        if not samples:
            continue
        family: GaugeMetricFamily | CounterMetricFamily
        if key.endswith("_total"):
            family = CounterMetricFamily(f"governor_worker_{key[:-6]}", help_text, labels=["worker"])
        else:
            family = GaugeMetricFamily(f"governor_worker_{key}", help_text, labels=["worker"])
        for address, value in samples:
            family.add_metric([address], value)
        yield family


def _endpoint_families(upstream: Upstream, now: float) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The pool's soft layer, one sample per endpoint (its worker address)."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "up": GaugeMetricFamily("governor_endpoint_up", "1 while the endpoint answers pings.", labels=["worker"]),
        "inflight": GaugeMetricFamily(
            "governor_endpoint_inflight", "Admitted requests without a final reply.", labels=["worker"]
        ),
        "executed": CounterMetricFamily(
            "governor_endpoint_executed", "Requests the endpoint completed with done.", labels=["worker"]
        ),
        "failed": CounterMetricFamily(
            "governor_endpoint_failed",
            "Requests that failed on the endpoint: lost with it, or an error it sent (not a client's 4xx,"
            " disconnect or deadline).",
            labels=["worker"],
        ),
        "concurrency": GaugeMetricFamily(
            "governor_endpoint_concurrency_limit", "The endpoint's concurrency cap; 0 = none.", labels=["worker"]
        ),
        "qps": GaugeMetricFamily(
            "governor_endpoint_qps_limit", "The endpoint's admissions-per-second cap; 0 = none.", labels=["worker"]
        ),
        "tokens": GaugeMetricFamily(
            "governor_endpoint_qps_tokens", "Admissions the endpoint's qps bucket holds now.", labels=["worker"]
        ),
        "inflight_tokens": GaugeMetricFamily(
            "governor_endpoint_inflight_tokens",
            "Token cost held by the endpoint's admitted, unfinished requests.",
            labels=["worker"],
        ),
        "tokens_limit": GaugeMetricFamily(
            "governor_endpoint_tokens_limit", "The endpoint's token budget (tokens=N); 0 = none.", labels=["worker"]
        ),
        "info": GaugeMetricFamily(
            "governor_endpoint_info",
            "1 per endpoint, labelled with its kind (worker: NDJSON worker process; openai: an "
            "OpenAI-compatible HTTP server) and the model it is asked for.",
            labels=["worker", "kind", "model"],
        ),
        "busy": CounterMetricFamily(
            "governor_endpoint_busy",
            "429/503 answers of an OpenAI-compatible endpoint (it was paused for its Retry-After).",
            labels=["worker"],
        ),
        "waiting": GaugeMetricFamily(
            "governor_endpoint_waiting",
            "The endpoint's admitted requests without a first token yet (what the TTFT prediction waits behind).",
            labels=["worker"],
        ),
    }
    for link in upstream.links:
        e = link.endpoint
        label = [link.endpoint.name]  # its address, or `spawned-N`: stable across restarts
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


def _token_families(
    state: ServerState, now: float
) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    """Token-cost admission (admission/cost.py, limits.TokenBudget, limits.TokenRate) and deadlines."""
    admission, acc = state.admission, state.accounting
    yield GaugeMetricFamily(
        "governor_inflight_tokens", "Token cost reserved by admitted, unfinished requests.", admission.tokens.held
    )
    yield GaugeMetricFamily(
        "governor_max_inflight_tokens", "Hard cap on governor_inflight_tokens; 0 = none.", admission.tokens.max_tokens
    )
    bucket = admission.token_rate.bucket
    yield GaugeMetricFamily(
        "governor_max_tokens_per_second",
        "Token cost admitted per second (--max-tokens-per-s); 0 = none.",
        0.0 if bucket is None else bucket.rate,
    )
    if bucket is not None:
        yield GaugeMetricFamily(
            "governor_token_rate_tokens", "Token cost the --max-tokens-per-s bucket holds now.", bucket.level(now)
        )
    yield CounterMetricFamily(
        "governor_tokens_reserved",
        "Token cost charged at admission (prompt estimate + weighted max_new_tokens).",
        acc.tokens_reserved,
    )
    yield CounterMetricFamily(
        "governor_tokens_settled",
        "Real token cost of the requests that ended (from the workers' counts).",
        acc.tokens_settled,
    )
    yield GaugeMetricFamily(
        "governor_bytes_per_token",
        "Prompt bytes per token used to estimate undeclared prompts.",
        state.costs.bytes_per_token,
    )
    ratio = HistogramMetricFamily(
        "governor_prompt_tokens_estimate_ratio",
        "Estimated or declared prompt tokens over the real count, per request (1 = exact).",
        labels=["source"],
    )
    for source, h in state.costs.accuracy.items():
        ratio.add_metric([source], h.cumulative(), h.total)
    yield ratio
    deadlines = CounterMetricFamily(
        "governor_deadlines",
        "Admitted requests with deadline_ms: met (first token in time) or expired (cancelled at the deadline).",
        labels=["outcome"],
    )
    for outcome, n in sorted(acc.deadlines.items()):
        deadlines.add_metric([outcome], n)
    yield deadlines
    predictions = CounterMetricFamily(
        "governor_deadline_predictions",
        "Admitted requests with deadline_ms whose TTFT was predicted: first token within the prediction"
        " (covered) or later or never (exceeded); the margin is learnt to cover about 95%.",
        labels=["outcome"],
    )
    for outcome, n in sorted(acc.predictions.items()):
        predictions.add_metric([outcome], n)
    yield predictions
    yield GaugeMetricFamily(
        "governor_adaptive_limit",
        "The concurrency limit --adaptive-limit sets (enforce) or would set (shadow); --max-inflight when off.",
        admission.adaptive.limit if admission.adaptive.policy.mode is not AdaptiveMode.OFF else admission.max_inflight,
    )


def _tenant_families(state: ServerState, now: float) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per tenant and per priority class. The tenant label takes the table's names only (the
    configured tenants, those the token file names, and `default` for everyone else), so its
    cardinality is bounded by the configuration."""
    admission = state.admission
    tenants = list(admission.tenants)
    lowest, _, _ = admission.fair.floor(now)
    gauges = (
        ("governor_tenant_inflight", "The tenant's admitted requests without a final reply.", "inflight"),
        ("governor_tenant_inflight_tokens", "Token cost held by the tenant's admitted requests.", "tokens"),
    )
    for name, help_text, attr in gauges:
        gauge = GaugeMetricFamily(name, help_text, labels=["tenant"])
        for tenant in tenants:
            gauge.add_metric([tenant.name], getattr(tenant, attr))
        yield gauge
    weight = GaugeMetricFamily("governor_tenant_weight", "The tenant's weight in fair shares.", labels=["tenant"])
    lead = GaugeMetricFamily(
        "governor_tenant_service_lead",
        "How far the tenant's fair-share counter (token cost served / weight) is ahead of the least served"
        " contending tenant's; it yields tenant_share past --tenant-share-from while above 0.",
        labels=["tenant"],
    )
    for tenant in tenants:
        weight.add_metric([tenant.name], tenant.limits.weight)
        lead.add_metric([tenant.name], max(0.0, tenant.service - lowest) if lowest < math.inf else 0.0)
    yield weight
    yield lead
    guaranteed = GaugeMetricFamily(
        "governor_tenant_guaranteed_inflight",
        "Requests the tenant may hold past --max-inflight (its guaranteed_inflight); 0 = none.",
        labels=["tenant"],
    )
    for tenant in tenants:
        guaranteed.add_metric([tenant.name], tenant.limits.guaranteed_inflight)
    yield guaranteed
    ceilings = admission.ceilings.current(now)
    ceiling = GaugeMetricFamily(
        "governor_class_ceiling", "Fraction of each cap the priority class may fill now.", labels=["class"]
    )
    inflight = GaugeMetricFamily(
        "governor_class_inflight", "The class's admitted requests without a final reply.", labels=["class"]
    )
    for priority, tally in state.accounting.classes.items():
        ceiling.add_metric([priority.value], ceilings[priority.value])
        inflight.add_metric([priority.value], tally.inflight)
    yield ceiling
    yield inflight
    yield GaugeMetricFamily(
        "governor_class_allowance",
        "Requests critical frames may be admitted past --max-inflight (--class-allowance critical=D); 0 = none.",
        value=admission.inflight.allowance,
    )
    preempted = CounterMetricFamily(
        "governor_preempted",
        "Admitted requests displaced before their first token by a higher class (yield `preempted`),"
        " by their class and tenant.",
        labels=["class", "tenant"],
    )
    # Every class that can be displaced, for every tenant of the table, from the first scrape (0
    # until one is): rate() and the alert see the series before the first displacement.
    # A tenant dropped by a reload keeps its series, so the counter never goes back.
    total = admission.displacement.total
    keys = {(p.value, t.name) for p in (Priority.SHEDDABLE, Priority.STANDARD) for t in tenants} | total.keys()
    for priority_class, tenant_name in sorted(keys):
        preempted.add_metric([priority_class, tenant_name], total.get((priority_class, tenant_name), 0))
    yield preempted
    groups: tuple[tuple[str, str, list[tuple[str, Tally]]], ...] = (
        ("tenant", "tenant", [(t.name, t.tally) for t in tenants]),
        ("class", "priority class", [(p.value, tally) for p, tally in state.accounting.classes.items()]),
    )
    for label, what, tallies in groups:
        admitted = CounterMetricFamily(f"governor_{label}_admitted", f"Frames admitted, by {what}.", labels=[label])
        executed = CounterMetricFamily(
            f"governor_{label}_executed", f"Requests that ended with done, by {what}.", labels=[label]
        )
        tokens = CounterMetricFamily(
            f"governor_{label}_tokens", f"Real token cost of the requests that ended, by {what}.", labels=[label]
        )
        yielded = CounterMetricFamily(
            f"governor_{label}_yielded", f"Frames answered with yield, by {what} and reason.", labels=[label, "reason"]
        )
        for name, tally in tallies:
            admitted.add_metric([name], tally.admitted)
            executed.add_metric([name], tally.executed)
            tokens.add_metric([name], tally.tokens_settled)
            for reason, n in sorted(tally.yielded.items()):
                yielded.add_metric([name, reason], n)
        yield from (admitted, executed, tokens, yielded)


def _fleet_families(
    member: FleetMember,
) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    """This replica's lease on the fleet caps (--fleet), one sample per shared resource."""
    lease = member.lease
    yield GaugeMetricFamily(
        "governor_fleet_up", "1 while this replica's last lease renewal in Redis succeeded.", int(member.up)
    )
    state = GaugeMetricFamily(
        "governor_fleet_lease_state",
        "1 for the lease's state, 0 for the others: leased, joining, or lapsed into the --fleet-unavailable"
        " fallback (holding, closed, local).",
        labels=["state"],
    )
    for each in FleetState:  # every state, 1 for the current one (a state set: selectors always match)
        state.add_metric([each.value], int(each is lease.state))
    yield state
    yield GaugeMetricFamily(
        "governor_fleet_replicas", "Live replicas of the fleet, as of the last renewal.", lease.replicas
    )
    yield GaugeMetricFamily(
        "governor_fleet_lapsed_replicas",
        "Replicas whose lease lapsed but whose reservation Redis still keeps (dead, or cut off from Redis and"
        " perhaps still serving), as of the last renewal.",
        lease.lapsed,
    )
    age_ms = member.renewal_age_ms()
    if age_ms is not None:
        yield GaugeMetricFamily(
            "governor_fleet_renewal_age_seconds",
            "Since the last successful lease renewal was sent; the lease lapses when it reaches --fleet-lease-ms.",
            age_ms / 1000,
        )
    families = {
        "limit": GaugeMetricFamily("governor_fleet_limit", "The fleet-wide cap in force.", labels=["resource"]),
        "share": GaugeMetricFamily(
            "governor_fleet_lease",
            "This replica's share of the fleet cap (its lease): slots or tokens held, or per second.",
            labels=["resource"],
        ),
        "used": GaugeMetricFamily(
            "governor_fleet_used",
            "What this replica uses of its share: held now, or per second over the last renewal period.",
            labels=["resource"],
        ),
        "fleet_used": GaugeMetricFamily(
            "governor_fleet_usage",
            "What the whole fleet uses, as of this replica's last renewal (held, or per second).",
            labels=["resource"],
        ),
        "fleet_wants": GaugeMetricFamily(
            "governor_fleet_wants",
            "What the whole fleet asks for (usage plus refused demand), as of this replica's last renewal.",
            labels=["resource"],
        ),
        "fleet_granted": GaugeMetricFamily(
            "governor_fleet_granted",
            "What Redis keeps reserved over every replica (their grants, lapsed ones included), as of this"
            " replica's last renewal: never above governor_fleet_limit.",
            labels=["resource"],
        ),
    }
    for resource, share in zip(RESOURCES, lease.shares, strict=True):
        if share.limit:
            families["limit"].add_metric([resource], share.limit)
            families["share"].add_metric([resource], share.share)
            families["used"].add_metric([resource], share.used)
            families["fleet_used"].add_metric([resource], share.fleet_usage)
            families["fleet_wants"].add_metric([resource], share.fleet_want)
            families["fleet_granted"].add_metric([resource], share.fleet_granted)
    yield from families.values()
    renewals = CounterMetricFamily(
        "governor_fleet_renewals", "Lease renewals sent to Redis, by result.", labels=["result"]
    )
    for result, n in sorted(member.renewals.items()):
        renewals.add_metric([result], n)
    yield renewals
    yield CounterMetricFamily(
        "governor_fleet_cuts",
        "Times the lease stayed lapsed past its reservation in Redis and the requests still running were"
        " cancelled (fleet_lease_lost).",
        member.cuts,
    )
    yield CounterMetricFamily(
        "governor_fleet_unacked_renewals",
        "Renewals that too few Redis replicas acknowledged in time (--fleet-replica-acks): a share they grew"
        " was not applied.",
        member.unacked,
    )
    h = member.renewal_seconds
    yield HistogramMetricFamily(
        "governor_fleet_renewal_seconds",
        "Round trip of a successful lease renewal (the Lua script in Redis).",
        buckets=h.cumulative(),
        sum_value=h.total,
    )


def _hint_families(state: ServerState) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
    """Whether the retry hints hold (admission/appointments.py) and how far off the release
    forecast they are read from is (admission/release_forecast.py)."""
    admission = state.admission
    appointments = admission.appointments
    appointments.tidy(state.clock())  # closed windows lapse, no-shows past memory count, before a scrape
    outcomes = CounterMetricFamily(
        "governor_retry_hint_outcome",
        "Returns of refused clients to their appointment, by the limit that booked it and outcome:"
        " on_time (came in its window, admitted), early, late, yielded_again (came in its window,"
        " still no room), refused_elsewhere (came in its window, refused by another limit), never (did not"
        " come back).",
        labels=["reason", "outcome"],
    )
    open_by_reason = appointments.open_by_reason()
    counts = appointments.outcomes
    for reason in open_by_reason:  # every series from the first scrape, at 0
        for outcome in OUTCOMES:
            outcomes.add_metric([reason, outcome], counts.get((reason, outcome), 0))
    yield outcomes
    booked = GaugeMetricFamily(
        "governor_appointments",
        "Appointments booked and not yet redeemed, by the limit that booked them.",
        labels=["reason"],
    )
    for reason, n in open_by_reason.items():
        booked.add_metric([reason], n)
    yield booked
    trust = GaugeMetricFamily(
        "governor_appointments_trust",
        "The recent share of appointments their clients came back for (decayed), by the limit that booked"
        " them: the lowest over its books and the ranks they booked for. Below 0.5 a book's appointments of"
        " that rank keep no capacity and their hints are the plain forecast, until clients come back again.",
        labels=["reason"],
    )
    for reason, value in appointments.trust_by_reason().items():
        trust.add_metric([reason], value)
    yield trust
    final = CounterMetricFamily(
        "governor_refused_final",
        "Yields that told their client not to come back (x-should-retry: false, final: true): nothing"
        " frees within the promise horizon. Also counted in governor_yielded, by the limit that refused.",
        labels=["reason"],
    )
    for reason, n in state.accounting.final.items():
        final.add_metric([reason], n)
    yield final
    yield GaugeMetricFamily(
        "governor_lobby_held",
        "Returning clients held for the capacity kept for them (at most the open appointments).",
        len(state.lobby),
    )
    wait = state.lobby.wait
    yield HistogramMetricFamily(
        "governor_lobby_wait_seconds",
        "How long a returning client was held before its answer (admitted, or refused for good at its horizon).",
        buckets=wait.cumulative(),
        sum_value=wait.total,
    )
    h = admission.forecast.error
    yield HistogramMetricFamily(
        "governor_release_forecast_error_seconds",
        "Forecast minus actual end of a request, for the first forecast made of it (negative: it ended later).",
        buckets=h.cumulative(),
        sum_value=h.total,
    )


class GovernorCollector(Collector):
    def __init__(self, state: ServerState, upstream: Upstream, served_model: str = "gpt2") -> None:
        self._state = state
        self._upstream = upstream
        self._served_model = served_model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        s = self._state
        acc = s.accounting
        admission = s.admission
        now = s.clock()
        yield GaugeMetricFamily(
            "governor_inflight", "Admitted generate requests without a final reply.", admission.inflight.inflight
        )
        yield GaugeMetricFamily(
            "governor_max_inflight",
            "Hard cap on governor_inflight (the adaptive limit under --adaptive-limit enforce).",
            admission.inflight.max_inflight,
        )
        yield GaugeMetricFamily("governor_connections", "Open client connections.", len(s.connections))
        by_protocol = GaugeMetricFamily(
            "governor_protocol_connections",
            "Open client connections by front door: ndjson (--port) or http (--http-port).",
            labels=["protocol"],
        )
        for protocol, n in sorted(s.connections_by_protocol().items()):
            by_protocol.add_metric([protocol], n)
        yield by_protocol
        received = CounterMetricFamily(
            "governor_protocol_received",
            "Generate frames (NDJSON) and completion requests (HTTP) received, by front door.",
            labels=["protocol"],
        )
        received.add_metric(["ndjson"], acc.received - acc.http_received)
        received.add_metric(["http"], acc.http_received)
        yield received
        yield GaugeMetricFamily(
            "governor_draining", "1 while the governor drains for shutdown.", int(admission.draining)
        )
        yield CounterMetricFamily(
            "governor_received", "Generate frames received (incl. unreadable ones).", acc.received
        )
        yield CounterMetricFamily("governor_executed", "Requests that ended with a done reply.", acc.executed)
        for name, help_text, by_reason in (
            ("governor_connections_shed", "Client connections the governor closed, by reason.", acc.shed),
            ("governor_yielded", "Frames answered with yield, by the limit that refused them.", acc.yielded),
            ("governor_rejected", "Frames refused as invalid, by error code.", acc.rejected),
            ("governor_failed", "Admitted requests that failed, by reason.", acc.failed),
        ):
            family = CounterMetricFamily(name, help_text, labels=["reason"])
            for reason, n in sorted(by_reason.items()):
                family.add_metric([reason], n)
            yield family
        yield from _endpoint_families(self._upstream, now)
        yield from _model_server_families(s, self._upstream, self._served_model)
        attempts = CounterMetricFamily(
            "governor_requests",
            "Generate frames admission answered, by attempt (retry: back for an appointment, or the client"
            " says so, e.g. x-stainless-retry-count > 0) and answer.",
            labels=["attempt", "answer"],
        )
        for attempt, by_answer in acc.attempts.items():
            for answer, n in by_answer.items():
                attempts.add_metric([attempt, answer], n)
        yield attempts
        blind = CounterMetricFamily(
            "governor_blind_retries",
            'Retries without a valid appointment (of governor_requests_total{attempt="retry"}), by answer.',
            labels=["answer"],
        )
        for answer, n in acc.blind_retries.items():
            blind.add_metric([answer], n)
        yield blind
        yield from _token_families(s, now)
        yield from _hint_families(s)
        yield from _tenant_families(s, now)
        if s.fleet is not None:
            yield from _fleet_families(s.fleet)
        bucket = admission.rate.bucket
        if bucket is not None:
            yield GaugeMetricFamily(
                "governor_qps_tokens", "Admissions the --max-qps token bucket holds now.", bucket.level(now)
            )
        yield from _worker_stats_families(self._upstream.worker_links)
        yield CounterMetricFamily(
            "governor_worker_restarts", "Spawned workers restarted after exiting.", acc.worker_restarts
        )
        yield CounterMetricFamily(
            "governor_rerouted",
            "Requests moved to another endpoint after theirs was lost before starting.",
            acc.rerouted,
        )
        for attr, help_text in _HISTOGRAM_HELP.items():
            h: Histogram = getattr(s.latency, attr)
            yield HistogramMetricFamily(
                f"governor_{attr}_seconds", help_text, buckets=h.cumulative(), sum_value=h.total
            )
        hints = HistogramMetricFamily(
            "governor_retry_hint_seconds",
            "The retry hints handed out with yields (retry_hint_ms, retry-after-ms), by the reason of the yield.",
            labels=["reason"],
        )
        for reason in YieldReason:  # every series from the first scrape
            h = s.latency.retry_hints.get(reason) or _NO_HINTS
            hints.add_metric([reason.value], h.cumulative(), h.total)
        yield hints


def _model_server_families(state: ServerState, upstream: Upstream, served_model: str) -> Iterator[GaugeMetricFamily]:
    """The gauges a Gateway API Inference Extension endpoint picker scrapes from a vLLM pod, as the
    governor sees them, one series per model the front door serves (vLLM's `model_name` label):
    running = its endpoints' admitted, unfinished requests; waiting = the returning clients held
    in the lobby (nothing else waits here: a refusal is an answer); the KV cache's use = the mean
    of what its governor workers report, left out for a model no worker serves (an
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
    held = len(state.lobby)
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


def build_registry(state: ServerState, upstream: Upstream, served_model: str = "gpt2") -> CollectorRegistry:
    """`served_model`: the name the front door serves the governor's own workers as."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GovernorCollector(state, upstream, served_model))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
