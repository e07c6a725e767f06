"""Prometheus exposition of the governor's own counters.

The hot path only bumps plain ints (see accounting.py) and `Histogram.observe` (a bisect and two
adds); prometheus-client's own Counter/Histogram take a lock per call, which the yield path cannot
afford. A custom collector turns the plain values into metric families at scrape time: it reads the
governor once (snapshot/, what `stats` shows too) and the links (link_metrics.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from governor.admission.appointments.registry import OUTCOMES
from governor.fleet.lease import FleetState
from governor.latency import HINT_BUCKETS, Histogram
from governor.links.upstream import Upstream
from governor.report.link_metrics import endpoint_families, model_server_families, worker_stats_families
from governor.report.snapshot.fleet import FleetReading
from governor.report.snapshot.parts import Counts, HistogramReading, TallyReading, Tenancy
from governor.report.snapshot.reading import Snapshot, read
from governor.state import ServerState
from govwire.vocab import YieldReason

Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily

_NO_HINTS = HistogramReading.of(Histogram(HINT_BUCKETS))  # a reason that has handed out no hint yet

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


def _histogram(name: str, help_text: str, h: HistogramReading) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, help_text, buckets=list(h.buckets), sum_value=h.total)


def _by_label(family: CounterMetricFamily | GaugeMetricFamily, values: Mapping[str, float]) -> Family:
    """`family` with one sample per key of `values`, as they are ordered."""
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def _load_families(snap: Snapshot) -> Iterator[Family]:
    """In flight, the cap, the connections by front door, and whether it drains."""
    yield GaugeMetricFamily("governor_inflight", "Admitted generate requests without a final reply.", snap.inflight)
    yield GaugeMetricFamily(
        "governor_max_inflight",
        "Hard cap on governor_inflight (the adaptive limit under --adaptive-limit enforce).",
        snap.max_inflight,
    )
    yield GaugeMetricFamily("governor_connections", "Open client connections.", snap.connections)
    by_protocol = GaugeMetricFamily(
        "governor_protocol_connections",
        "Open client connections by front door: ndjson (--port) or http (--http-port).",
        labels=["protocol"],
    )
    yield _by_label(by_protocol, dict(sorted(snap.connections_by_protocol.items())))
    received = CounterMetricFamily(
        "governor_protocol_received",
        "Generate frames (NDJSON) and completion requests (HTTP) received, by front door.",
        labels=["protocol"],
    )
    yield _by_label(received, snap.counts.received_by_protocol)
    yield GaugeMetricFamily("governor_draining", "1 while the governor drains for shutdown.", int(snap.draining))


def _outcome_families(counts: Counts) -> Iterator[Family]:
    """Where the frames ended up: received, executed, and the rest by reason."""
    yield CounterMetricFamily("governor_received", "Generate frames received (incl. unreadable ones).", counts.received)
    yield CounterMetricFamily("governor_executed", "Requests that ended with a done reply.", counts.executed)
    for name, help_text, by_reason in (
        ("governor_connections_shed", "Client connections the governor closed, by reason.", counts.shed),
        ("governor_yielded", "Frames answered with yield, by the limit that refused them.", counts.yielded),
        ("governor_rejected", "Frames refused as invalid, by error code.", counts.rejected),
        ("governor_failed", "Admitted requests that failed, by reason.", counts.failed),
    ):
        yield _by_label(CounterMetricFamily(name, help_text, labels=["reason"]), dict(sorted(by_reason.items())))


def _attempt_families(counts: Counts) -> Iterator[Family]:
    """Admission's answers to first attempts and retries, and the blind retries among them."""
    attempts = CounterMetricFamily(
        "governor_requests",
        "Generate frames admission answered, by attempt (retry: back for an appointment, or the client"
        " says so, e.g. x-stainless-retry-count > 0) and answer.",
        labels=["attempt", "answer"],
    )
    for attempt, by_answer in counts.attempts.items():
        for answer, n in by_answer.items():
            attempts.add_metric([attempt, answer], n)
    yield attempts
    blind = CounterMetricFamily(
        "governor_blind_retries",
        'Retries without a valid appointment (of governor_requests_total{attempt="retry"}), by answer.',
        labels=["answer"],
    )
    yield _by_label(blind, counts.blind_retries)


def _token_families(snap: Snapshot) -> Iterator[Family]:
    """Token-cost admission (admission/cost.py, limits.TokenBudget, limits.TokenRate)."""
    tokens = snap.tokens
    yield GaugeMetricFamily(
        "governor_inflight_tokens", "Token cost reserved by admitted, unfinished requests.", tokens.held
    )
    yield GaugeMetricFamily(
        "governor_max_inflight_tokens", "Hard cap on governor_inflight_tokens; 0 = none.", tokens.max_tokens
    )
    yield GaugeMetricFamily(
        "governor_max_tokens_per_second",
        "Token cost admitted per second (--max-tokens-per-s); 0 = none.",
        0.0 if tokens.rate is None else tokens.rate.rate,
    )
    if tokens.rate is not None:
        yield GaugeMetricFamily(
            "governor_token_rate_tokens", "Token cost the --max-tokens-per-s bucket holds now.", tokens.rate.level
        )
    yield CounterMetricFamily(
        "governor_tokens_reserved",
        "Token cost charged at admission (prompt estimate + weighted max_new_tokens).",
        tokens.reserved_total,
    )
    yield CounterMetricFamily(
        "governor_tokens_settled",
        "Real token cost of the requests that ended (from the workers' counts).",
        tokens.settled_total,
    )
    yield GaugeMetricFamily(
        "governor_bytes_per_token",
        "Prompt bytes per token used to estimate undeclared prompts.",
        tokens.bytes_per_token,
    )
    ratio = HistogramMetricFamily(
        "governor_prompt_tokens_estimate_ratio",
        "Estimated or declared prompt tokens over the real count, per request (1 = exact).",
        labels=["source"],
    )
    for source, h in tokens.estimate_ratio.items():
        ratio.add_metric([source], list(h.buckets), h.total)
    yield ratio


def _deadline_families(snap: Snapshot) -> Iterator[Family]:
    """Deadline outcomes, how the TTFT predictions held, and the adaptive limit."""
    deadlines = CounterMetricFamily(
        "governor_deadlines",
        "Admitted requests with deadline_ms: met (first token in time) or expired (cancelled at the deadline).",
        labels=["outcome"],
    )
    yield _by_label(deadlines, dict(sorted(snap.deadlines.outcomes.items())))
    predictions = CounterMetricFamily(
        "governor_deadline_predictions",
        "Admitted requests with deadline_ms whose TTFT was predicted: first token within the prediction"
        " (covered) or later or never (exceeded); the margin is learnt to cover about 95%.",
        labels=["outcome"],
    )
    yield _by_label(predictions, dict(sorted(snap.deadlines.predictions.items())))
    yield GaugeMetricFamily(
        "governor_adaptive_limit",
        "The concurrency limit --adaptive-limit sets (enforce) or would set (shadow); --max-inflight when off.",
        snap.adaptive_limit,
    )


def _tenant_families(tenancy: Tenancy) -> Iterator[Family]:
    """Per tenant. The tenant label takes the table's names only (the configured tenants, those
    the token file names, and `default` for everyone else), so its cardinality is bounded by the
    configuration."""
    tenants = tenancy.tenants
    gauges = (
        ("governor_tenant_inflight", "The tenant's admitted requests without a final reply.", "inflight"),
        ("governor_tenant_inflight_tokens", "Token cost held by the tenant's admitted requests.", "inflight_tokens"),
    )
    for name, help_text, attr in gauges:
        gauge = GaugeMetricFamily(name, help_text, labels=["tenant"])
        yield _by_label(gauge, {t.name: getattr(t, attr) for t in tenants})
    weight = GaugeMetricFamily("governor_tenant_weight", "The tenant's weight in fair shares.", labels=["tenant"])
    lead = GaugeMetricFamily(
        "governor_tenant_service_lead",
        "How far the tenant's fair-share counter (token cost served / weight) is ahead of the least served"
        " contending tenant's; it yields tenant_share past --tenant-share-from while above 0.",
        labels=["tenant"],
    )
    yield _by_label(weight, {t.name: t.limits.weight for t in tenants})
    yield _by_label(lead, {t.name: t.service_lead for t in tenants})
    guaranteed = GaugeMetricFamily(
        "governor_tenant_guaranteed_inflight",
        "Requests the tenant may hold past --max-inflight (its guaranteed_inflight); 0 = none.",
        labels=["tenant"],
    )
    yield _by_label(guaranteed, {t.name: t.limits.guaranteed_inflight for t in tenants})


def _class_families(snap: Snapshot) -> Iterator[Family]:
    """Per priority class: its ceiling and load, the critical allowance, and who was displaced."""
    classes = snap.tenancy.classes
    ceiling = GaugeMetricFamily(
        "governor_class_ceiling", "Fraction of each cap the priority class may fill now.", labels=["class"]
    )
    inflight = GaugeMetricFamily(
        "governor_class_inflight", "The class's admitted requests without a final reply.", labels=["class"]
    )
    yield _by_label(ceiling, {c.name: c.ceiling for c in classes})
    yield _by_label(inflight, {c.name: c.tally.inflight for c in classes})
    yield GaugeMetricFamily(
        "governor_class_allowance",
        "Requests critical frames may be admitted past --max-inflight (--class-allowance critical=D); 0 = none.",
        value=snap.critical_allowance,
    )
    preempted = CounterMetricFamily(
        "governor_preempted",
        "Admitted requests displaced before their first token by a higher class (yield `preempted`),"
        " by their class and tenant.",
        labels=["class", "tenant"],
    )
    for (priority_class, tenant_name), n in snap.tenancy.preempted.items():
        preempted.add_metric([priority_class, tenant_name], n)
    yield preempted


def _tally_families(tenancy: Tenancy) -> Iterator[Family]:
    """What each tenant's and each class's frames came to (admission/tally.py)."""
    groups: tuple[tuple[str, str, list[tuple[str, TallyReading]]], ...] = (
        ("tenant", "tenant", [(t.name, t.tally) for t in tenancy.tenants]),
        ("class", "priority class", [(c.name, c.tally) for c in tenancy.classes]),
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


def _fleet_lease_families(fleet: FleetReading) -> Iterator[Family]:
    """This replica's lease on the fleet caps (--fleet): whether it is renewed, and its state."""
    yield GaugeMetricFamily(
        "governor_fleet_up", "1 while this replica's last lease renewal in Redis succeeded.", int(fleet.up)
    )
    state = GaugeMetricFamily(
        "governor_fleet_lease_state",
        "1 for the lease's state, 0 for the others: leased, joining, or lapsed into the --fleet-unavailable"
        " fallback (holding, closed, local).",
        labels=["state"],
    )
    # every state, 1 for the current one (a state set: selectors always match)
    yield _by_label(state, {each.value: int(each.value == fleet.state) for each in FleetState})
    yield GaugeMetricFamily(
        "governor_fleet_replicas", "Live replicas of the fleet, as of the last renewal.", fleet.replicas
    )
    yield GaugeMetricFamily(
        "governor_fleet_lapsed_replicas",
        "Replicas whose lease lapsed but whose reservation Redis still keeps (dead, or cut off from Redis and"
        " perhaps still serving), as of the last renewal.",
        fleet.lapsed,
    )
    if fleet.renewal_age_ms is not None:
        yield GaugeMetricFamily(
            "governor_fleet_renewal_age_seconds",
            "Since the last successful lease renewal was sent; the lease lapses when it reaches --fleet-lease-ms.",
            fleet.renewal_age_ms / 1000,
        )


# ShareReading field -> (name, help): one sample per shared resource (the caps in use).
_FLEET_SHARE_FAMILIES = {
    "limit": ("governor_fleet_limit", "The fleet-wide cap in force."),
    "share": (
        "governor_fleet_lease",
        "This replica's share of the fleet cap (its lease): slots or tokens held, or per second.",
    ),
    "used": (
        "governor_fleet_used",
        "What this replica uses of its share: held now, or per second over the last renewal period.",
    ),
    "fleet_usage": (
        "governor_fleet_usage",
        "What the whole fleet uses, as of this replica's last renewal (held, or per second).",
    ),
    "fleet_want": (
        "governor_fleet_wants",
        "What the whole fleet asks for (usage plus refused demand), as of this replica's last renewal.",
    ),
    "fleet_granted": (
        "governor_fleet_granted",
        "What Redis keeps reserved over every replica (their grants, lapsed ones included), as of this"
        " replica's last renewal: never above governor_fleet_limit.",
    ),
}


def _fleet_share_families(fleet: FleetReading) -> Iterator[Family]:
    """Per shared cap: the fleet's limit, this replica's share and use, and the fleet's."""
    for attr, (name, help_text) in _FLEET_SHARE_FAMILIES.items():
        family = GaugeMetricFamily(name, help_text, labels=["resource"])
        yield _by_label(family, {share.resource: getattr(share, attr) for share in fleet.shares})


def _fleet_renewal_families(fleet: FleetReading) -> Iterator[Family]:
    """The lease's renewals: by result, the cuts, the unacknowledged ones, and their round trip."""
    renewals = CounterMetricFamily(
        "governor_fleet_renewals", "Lease renewals sent to Redis, by result.", labels=["result"]
    )
    yield _by_label(renewals, dict(sorted(fleet.renewals.items())))
    yield CounterMetricFamily(
        "governor_fleet_cuts",
        "Times the lease stayed lapsed past its reservation in Redis and the requests still running were"
        " cancelled (fleet_lease_lost).",
        fleet.cuts,
    )
    yield CounterMetricFamily(
        "governor_fleet_unacked_renewals",
        "Renewals that too few Redis replicas acknowledged in time (--fleet-replica-acks): a share they grew"
        " was not applied.",
        fleet.unacked,
    )
    yield _histogram(
        "governor_fleet_renewal_seconds",
        "Round trip of a successful lease renewal (the Lua script in Redis).",
        fleet.renewal_seconds,
    )


def _hint_families(snap: Snapshot) -> Iterator[Family]:
    """Whether the retry hints hold (admission/appointments/): the returns' outcomes, the
    appointments open, and their clients' trust."""
    hints = snap.hints
    outcomes = CounterMetricFamily(
        "governor_retry_hint_outcome",
        "Returns of refused clients to their appointment, by the limit that booked it and outcome:"
        " on_time (came in its window, admitted), early, late, yielded_again (came in its window,"
        " still no room), refused_elsewhere (came in its window, refused by another limit), never (did not"
        " come back).",
        labels=["reason", "outcome"],
    )
    for reason in hints.appointments:  # every series from the first scrape, at 0
        for outcome in OUTCOMES:
            outcomes.add_metric([reason, outcome], hints.outcomes.get((reason, outcome), 0))
    yield outcomes
    booked = GaugeMetricFamily(
        "governor_appointments",
        "Appointments booked and not yet redeemed, by the limit that booked them.",
        labels=["reason"],
    )
    yield _by_label(booked, hints.appointments)
    trust = GaugeMetricFamily(
        "governor_appointments_trust",
        "The recent share of appointments their clients came back for (decayed), by the limit that booked"
        " them: the lowest over its books and the ranks they booked for. Below 0.5 a book's appointments of"
        " that rank keep no capacity and their hints are the plain forecast, until clients come back again.",
        labels=["reason"],
    )
    yield _by_label(trust, hints.trust)


def _lobby_families(snap: Snapshot) -> Iterator[Family]:
    """The refusals for good, the lobby, and how far off the release forecast the hints are read
    from is (admission/release_forecast.py)."""
    final = CounterMetricFamily(
        "governor_refused_final",
        "Yields that told their client not to come back (x-should-retry: false, final: true): nothing"
        " frees within the promise horizon. Also counted in governor_yielded, by the limit that refused.",
        labels=["reason"],
    )
    yield _by_label(final, snap.counts.final)
    yield CounterMetricFamily(
        "governor_backfilled",
        "Admissions into a slot kept for an appointment whose time is after the newcomer's forecast end"
        " (the slot is due back before its holder; one that overruns leaves the holder in the lobby).",
        snap.hints.backfilled,
    )
    yield GaugeMetricFamily(
        "governor_lobby_held",
        "Returning clients held for the capacity kept for them (at most the open appointments).",
        snap.lobby_held,
    )
    yield _histogram(
        "governor_lobby_wait_seconds",
        "How long a returning client was held before its answer (admitted, or refused for good at its horizon).",
        snap.lobby_wait,
    )
    yield _histogram(
        "governor_release_forecast_error_seconds",
        "Forecast minus actual end of a request, for the first forecast made of it (negative: it ended later).",
        snap.hints.forecast_error,
    )


def _latency_families(snap: Snapshot) -> Iterator[Family]:
    """The latency histograms, and the retry hints handed out by yield reason."""
    for attr, help_text in _HISTOGRAM_HELP.items():
        yield _histogram(f"governor_{attr}_seconds", help_text, snap.latency.histograms[attr])
    hints = HistogramMetricFamily(
        "governor_retry_hint_seconds",
        "The retry hints handed out with yields (retry_hint_ms, retry-after-ms), by the reason of the yield.",
        labels=["reason"],
    )
    for reason in YieldReason:  # every series from the first scrape
        h = snap.latency.retry_hints.get(reason) or _NO_HINTS
        hints.add_metric([reason.value], list(h.buckets), h.total)
    yield hints


class GovernorCollector(Collector):
    def __init__(self, state: ServerState, upstream: Upstream, served_model: str = "gpt2") -> None:
        self._state = state
        self._upstream = upstream
        self._served_model = served_model

    def collect(self) -> Iterator[Family]:
        """The governor's families from one snapshot, the links' between them."""
        snap = read(self._state)
        upstream = self._upstream
        yield from _load_families(snap)
        yield from _outcome_families(snap.counts)
        yield from endpoint_families(upstream, self._state.clock())
        yield from model_server_families(snap.lobby_held, upstream, self._served_model)
        yield from _attempt_families(snap.counts)
        yield from _token_families(snap)
        yield from _deadline_families(snap)
        yield from _hint_families(snap)
        yield from _lobby_families(snap)
        yield from _tenant_families(snap.tenancy)
        yield from _class_families(snap)
        yield from _tally_families(snap.tenancy)
        if snap.fleet is not None:
            yield from _fleet_lease_families(snap.fleet)
            yield from _fleet_share_families(snap.fleet)
            yield from _fleet_renewal_families(snap.fleet)
        if snap.qps is not None:
            yield GaugeMetricFamily(
                "governor_qps_tokens", "Admissions the --max-qps token bucket holds now.", snap.qps.level
            )
        yield from worker_stats_families(upstream.worker_links)
        yield CounterMetricFamily(
            "governor_worker_restarts", "Spawned workers restarted after exiting.", snap.counts.worker_restarts
        )
        yield CounterMetricFamily(
            "governor_rerouted",
            "Requests moved to another endpoint after theirs was lost before starting.",
            snap.counts.rerouted,
        )
        yield from _latency_families(snap)


def build_registry(state: ServerState, upstream: Upstream, served_model: str = "gpt2") -> CollectorRegistry:
    """`served_model`: the name the front door serves the governor's own workers as."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GovernorCollector(state, upstream, served_model))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
