"""Server lifecycle in named phases: start up (workers, links, metrics, listener), run until a
signal, drain, shut down (one teardown stack), exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import resource
import signal
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from governor.admission.adaptive_limit import AdaptiveMode, AdaptivePolicy
from governor.admission.cost import CostModel
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits, OpenAITarget
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.ttft import TtftModel
from governor.doors.connection import ConnectionLimits, GovernorProtocol
from governor.doors.http import HttpIngress
from governor.doors.http_wire import HttpLimits
from governor.doors.turns import TurnQueue
from governor.fleet.lease import FleetLease
from governor.fleet.member import FleetMember
from governor.latency import sample_loop_lag
from governor.lifecycle import Phase
from governor.links.health import HealthPolicy
from governor.links.openai_link import OpenAILink
from governor.links.upstream import Upstream
from governor.report.metrics import build_registry
from governor.report.metrics_server import MetricsEndpoint
from governor.shell.config import GovernorConfig
from governor.shell.config_file import reload_config
from governor.shell.endpoints import parse_endpoint
from governor.shell.spawned import SPAWNED, SpawnedWorkers
from governor.state import ClientCore, ServerState
from govwire.address import Address
from govwire.auth import TenantSecrets
from govwire.errors import FleetLeaseLost
from govwire.options import ConfigError
from govwire.request import IntegrityMode, Limits

log = logging.getLogger("governor.server")

CANCEL_GRACE_S = 1.0  # after the drain deadline, how long the worker gets to confirm cancels
TIMEOUT_SWEEP_MAX_S = 1.0  # idle and unauthenticated connections are looked for at least this often


def build_state(config: GovernorConfig, upstream: Upstream, now: float) -> ServerState:
    """What every connection shares: admission and its tenants, the client secrets, what a
    request may ask and what it costs."""
    admission = build_admission(config, upstream, now)
    auth = config.client_secret()
    apply_tenancy(admission, config, auth, now)
    state = ServerState(
        limits=Limits(max_new_tokens=config.max_new_tokens_limit, integrity=IntegrityMode(config.integrity)),
        admission=admission,
        upstream=upstream,
        auth=auth,
        tenant_from_frame=config.tenant_from == "frame",
        costs=CostModel(
            config.bytes_per_token,
            config.output_token_weight,
            config.max_new_tokens_limit,
            calibrate=config.token_estimate == "calibrated",
        ),
    )
    state.tenant_from = config.tenant_from
    return state


def build_admission(config: GovernorConfig, upstream: Upstream, now: float) -> Admission:
    """The governor's own caps over the upstream's endpoints, the hints its refusals carry and
    the adaptive limit; its tenants are set apart (apply_tenancy), as a SIGHUP sets them again."""
    policy = RetryHintPolicy(
        base_ms=config.retry_hint_ms,
        min_ms=config.retry_hint_min_ms,
        max_ms=config.retry_hint_max_ms,
        horizon_ms=config.promise_horizon_ms,
        adaptive=config.retry_hint == "adaptive",
    )
    hints = RetryHintEstimator(policy, config.max_inflight)
    endpoints = [link.endpoint for link in upstream.links]
    adaptive = AdaptivePolicy(
        AdaptiveMode(config.adaptive_limit),
        floor=config.adaptive_limit_min,
        ceiling=config.max_inflight,
        throughput=config.adaptive_throughput,
        slowdown=config.adaptive_slowdown,
    )
    admission = Admission(
        endpoints,
        config.caps,
        hints,
        now,
        adaptive=adaptive,
        appointment_grace_s=config.appointment_grace_ms / 1000,
        served=True,  # a lifecycle and a lobby carry out its decisions (ServerState)
    )
    return admission


def served_models(upstream: Upstream, served_model: str) -> list[str]:
    """The model names the front door serves: each OpenAI-compatible endpoint's (its `served_as`,
    else its `model`), and `--served-model` when there are worker endpoints."""
    names = [link.target.served_name for link in upstream.links if isinstance(link, OpenAILink)]
    if upstream.worker_links:
        names.append(served_model)
    return list(dict.fromkeys(names))


def connection_limits(config: GovernorConfig) -> ConnectionLimits:
    return ConnectionLimits(
        max_frame_bytes=config.max_frame_bytes,
        max_connections=config.max_connections,
        max_buffer_bytes=config.max_buffer_bytes,
        max_write_buffer_bytes=config.max_write_buffer_bytes,
        idle_timeout_s=config.idle_timeout_s,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


async def sweep_timeouts(state: ServerState, idle_timeout_s: float) -> None:
    """Close connections past their auth deadline or idle timeout (doors/connection.py decides)."""
    interval = min(TIMEOUT_SWEEP_MAX_S, idle_timeout_s / 4) if idle_timeout_s else TIMEOUT_SWEEP_MAX_S
    while True:
        await asyncio.sleep(interval)
        now = state.clock()
        for connection in list(state.connections):
            connection.check_timeouts(now)


RELOADABLE = (
    "max_inflight",
    "appointment_grace_ms",
    "max_qps",
    "qps_burst",
    "max_inflight_tokens",
    "max_tokens_per_s",
    "tokens_burst",
    "worker",
    "tenant",
    "tenant_share_from",
    "sheddable_ceiling",
    "standard_ceiling",
    "priority_hold_s",
    "class_allowance",
    "tenant_loan",
    "preempt",
    "shed_blind_retries",
    "fleet_max_inflight",
    "fleet_max_qps",
    "fleet_qps_burst",
    "fleet_max_inflight_tokens",
    "fleet_max_tokens_per_s",
    "fleet_tokens_burst",
)


def apply_tenancy(admission: Admission, config: GovernorConfig, auth: TenantSecrets | None, now: float) -> None:
    """The tenant table: those the config gives limits, those the token file names, the default one."""
    admission.set_tenancy(
        config.tenant_limits(),
        auth.tenants if auth is not None else frozenset(),
        config.tenant_share_from,
        config.ceiling_policy(),
        now,
        preempt=config.preempt == "on",
        tenant_loan=config.tenant_loan,
    )
    admission.shed_blind_retries = config.shed_blind_retries


def apply_caps(state: ServerState, config: GovernorConfig, now: float) -> None:
    """Live cap changes. Lowering a cap never cancels a running request: it stops new admissions
    until in-flight falls under it. Endpoints are matched by address; adding or removing one
    needs a restart."""
    apply_tenancy(state.admission, config, state.auth, now)
    state.admission.set_caps(config.caps, now)
    state.admission.appointments.set_grace(config.appointment_grace_ms / 1000)
    if state.fleet is not None:
        state.fleet.lease.set_caps(config.fleet_policy(), now)
        state.admission.fleet_caps_changed()
    # Spawned workers are not the file's to list (it cannot add --worker endpoints to a spawning
    # governor), so only --worker endpoints are matched against it.
    endpoints = {e.name: e for e in state.admission.pool.endpoints if not e.name.startswith(SPAWNED)}
    for address, limits in (parse_endpoint(text) for text in config.worker):
        endpoint = endpoints.pop(str(address), None)
        if endpoint is None:
            log.warning("event=reload_endpoint_ignored address=%s reason=endpoints_change_on_restart", address)
        else:
            endpoint.set_limits(limits, now)
    for name in endpoints:  # in the running pool but no longer in the file: kept as they are
        log.warning("event=reload_endpoint_kept address=%s reason=endpoints_change_on_restart", name)
    state.lobby.freed()  # a cap raised may let a held client in now


async def announce_ready(upstream: Upstream, config: GovernorConfig, poll_s: float = 0.05) -> None:
    """Log `event=ready` once, when the first endpoint is up: the line to wait for after
    `make run` (`listening` comes seconds earlier, while the worker still loads its model)."""
    while not upstream.num_up:
        await asyncio.sleep(poll_s)
    log.info(
        "event=ready endpoints_up=%d ndjson=%s openai=%s hint=%s",
        upstream.num_up,
        Address(host=config.host, port=config.port),
        f"http://{Address(host=config.host, port=config.http_port)}/v1" if config.http_port else "off",
        "the governor serves requests now",
    )


def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one: each client connection is a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class Server:
    def __init__(self, config: GovernorConfig) -> None:
        self.config = config
        self._stop = asyncio.Event()
        self._skip_drain = asyncio.Event()

    def request_stop(self) -> None:
        """First signal: drain. A second one cuts the drain short (in-flight requests are cancelled)."""
        if self._stop.is_set():
            log.warning("event=drain_cut_short")
            self._skip_drain.set()
        self._stop.set()

    def reload(self, state: ServerState) -> None:
        """SIGHUP: re-read the config file and the client token file and apply their caps,
        tenants and secrets; nothing running is touched (connections keep their tenant)."""
        try:
            new = reload_config(self.config) if self.config.config else self.config
            auth = new.client_secret()
        except ConfigError as exc:
            log.error("event=reload_failed error=%r", str(exc))
            return
        state.auth = auth
        apply_caps(state, new, time.monotonic())
        caps = {name: getattr(new, name) for name in RELOADABLE}
        ignored = [
            name for name, value in vars(new).items() if name not in RELOADABLE and value != getattr(self.config, name)
        ]
        if ignored:
            log.warning("event=reload_needs_restart settings=%s", ",".join(ignored))
        self.config = dataclasses.replace(self.config, **caps)
        log.info(
            "event=reloaded max_inflight=%d max_qps=%g endpoints=%s tenants=%s",
            new.max_inflight,
            new.max_qps,
            new.worker,
            ",".join(t.name for t in state.admission.tenants),
        )

    async def serve(self) -> int:
        """Start up, run until a signal, drain, shut down: every resource is registered on one
        teardown stack as it is created, so shutdown releases them in reverse order whichever
        phase ended the run."""
        async with contextlib.AsyncExitStack() as stack:
            state, listeners = await self.start_up(stack)
            await self._stop.wait()
            log.info(
                "event=draining inflight=%d timeout_s=%.1f hint=%r",
                state.admission.inflight.inflight,
                self.config.drain_timeout_s,
                "a second Ctrl-C (SIGINT or SIGTERM) cancels what is still running and stops at once",
            )
            for listener in listeners:
                listener.close()
            await self._drain(state)
            executed = state.accounting.executed
        log.info("event=stopped executed=%d", executed)
        return 0

    async def start_up(self, stack: contextlib.AsyncExitStack) -> tuple[ServerState, list[asyncio.Server]]:
        """Workers (spawned or linked), the shared state, the metrics endpoint, then the listener;
        each registers its teardown on `stack` as it opens, so shutdown undoes them in reverse."""
        config = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
            stack.callback(loop.remove_signal_handler, sig)
        now = time.monotonic()
        upstream, spawned = self._link_workers(stack, now)
        state = build_state(config, upstream, now)
        await self._join_fleet(state, stack)
        if config.config or config.auth_token_file:
            loop.add_signal_handler(signal.SIGHUP, self.reload, state)
            stack.callback(loop.remove_signal_handler, signal.SIGHUP)
        if spawned is not None:
            spawned.start(upstream.worker_links, state.accounting.worker_restarted, stack)
        max_open_files = raise_fd_limit()
        if state.auth is None and not is_loopback(config.host):
            log.warning(
                "event=unauthenticated_bind host=%s hint=%r",
                config.host,
                "anyone who can reach this address can submit work; set --auth-token-file",
            )
        self._start_background(state, upstream, stack)
        registry = build_registry(state, upstream, config.served_model)  # scraped: --metrics-port, front door
        if config.metrics_port:
            metrics = MetricsEndpoint(registry, upstream.not_ready)
            await metrics.start(config.metrics_host or config.host, config.metrics_port)
            stack.push_async_callback(metrics.close)
        listeners = await self._open_listeners(state, upstream, registry, stack)
        self._announce(upstream, max_open_files, stack)
        return state, listeners

    def _link_workers(self, stack: contextlib.AsyncExitStack, now: float) -> tuple[Upstream, SpawnedWorkers | None]:
        """Links to the --worker endpoints, or to the workers it spawns. Nothing starts here: the
        spawned workers (returned) once the state that counts their restarts exists, the links
        once the fleet is joined (_start_background)."""
        config = self.config
        spawned: SpawnedWorkers | None = None
        specs: Sequence[tuple[Address | OpenAITarget, EndpointLimits]]
        if config.worker:
            specs = [parse_endpoint(text) for text in config.worker]
            names = [str(address) for address, _ in specs]  # an endpoint's name is its metrics label
            worker_secret = config.worker_secret()
        else:
            spawned = SpawnedWorkers(config.workers, config.worker_args, config.log_format)
            stack.callback(spawned.remove)
            specs, names, worker_secret = spawned.specs, spawned.names, spawned.secret
        health = HealthPolicy(
            config.worker_ping_interval_s, config.worker_ping_timeout_s, config.worker_stall_timeout_s
        )
        endpoints = [
            (address, Endpoint(name, limits, now, TtftModel(config.deadline_margin)))
            for (address, limits), name in zip(specs, names, strict=True)
        ]
        return Upstream(endpoints, health, worker_secret), spawned

    def _start_background(self, state: ServerState, upstream: Upstream, stack: contextlib.AsyncExitStack) -> None:
        """The links, the timeout sweep and the loop-lag sampler."""
        upstream.start()
        stack.push_async_callback(upstream.close)
        stack.callback(_close_connections, state)  # before the links close: their requests settle first
        sweeper = asyncio.create_task(sweep_timeouts(state, self.config.idle_timeout_s))
        stack.callback(sweeper.cancel)
        lag_sampler = asyncio.create_task(
            sample_loop_lag(state.latency.event_loop_lag, asyncio.get_running_loop().time)
        )
        stack.callback(lag_sampler.cancel)

    async def _open_listeners(
        self, state: ServerState, upstream: Upstream, registry: CollectorRegistry, stack: contextlib.AsyncExitStack
    ) -> list[asyncio.Server]:
        """The NDJSON port, then with --http-port the front door: one set of connection limits
        and one turn queue for both, whichever port a connection came in on."""
        config = self.config
        limits = connection_limits(config)
        turns = TurnQueue()  # one per loop: the frames every connection holds, a turn's worth per turn
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(
            lambda: GovernorProtocol(state, limits, turns), config.host, config.port, backlog=1024
        )
        stack.callback(listener.close)
        if not config.http_port:
            return [listener]
        models = served_models(upstream, config.served_model)
        front_door = await self._open_front_door(
            state, models, limits, turns, functools.partial(generate_latest, registry)
        )
        stack.callback(front_door.close)
        return [listener, front_door]

    def _announce(self, upstream: Upstream, max_open_files: int, stack: contextlib.AsyncExitStack) -> None:
        """Log `event=listening` with the settings an operator checks first, and start the task
        that logs `event=ready` once an endpoint is up (cancelled at teardown if none ever is)."""
        config = self.config
        log.info(
            "event=listening host=%s port=%d http_port=%d metrics_port=%d max_inflight=%d max_open_files=%d workers=%s",
            config.host,
            config.port,
            config.http_port,
            config.metrics_port,
            config.max_inflight,
            max_open_files,
            ",".join(link.address for link in upstream.links),
        )
        ready = asyncio.create_task(announce_ready(upstream, config))
        stack.callback(ready.cancel)

    async def _open_front_door(
        self,
        state: ServerState,
        models: list[str],
        limits: ConnectionLimits,
        turns: TurnQueue,
        metrics: Callable[[], bytes],
    ) -> asyncio.Server:
        """The OpenAI-compatible HTTP listener: the same state, admission and connection limits as
        the NDJSON port, an HTTP core per connection."""
        config = self.config
        http_limits = HttpLimits(
            max_body_bytes=config.max_frame_bytes,
            max_pipelined=config.http_max_pipelined,
            request_timeout_s=config.http_request_timeout_s,
            integrity=IntegrityMode(config.http_integrity),
            gateway=config.gateway_policy(),
        )

        def http_core(state: ServerState, write: Callable[[bytes], None], protocol: GovernorProtocol) -> ClientCore:
            trusted = http_limits.gateway.trusts(protocol.peer)
            return HttpIngress(
                state, write, http_limits, models, protocol.pause_reading, protocol.finish, metrics, trusted
            )

        loop = asyncio.get_running_loop()
        return await loop.create_server(
            lambda: GovernorProtocol(state, limits, turns, http_core, "http"),
            config.host,
            config.http_port,
            backlog=1024,
        )

    async def _join_fleet(self, state: ServerState, stack: contextlib.AsyncExitStack) -> None:
        """With --fleet: the lease, enforced by admission from the first frame, its first renewal
        before the listener opens, and its renewals from then on. It leaves the fleet last, once
        the drain is over (its requests hold their share until they end)."""
        config = self.config
        if not config.fleet:
            return
        lease = FleetLease(config.fleet_policy(), state.admission.hints, time.monotonic())
        state.admission.join_fleet(lease, promises=config.fleet_promises == "on")
        member = FleetMember(
            config.fleet,
            config.fleet_name,
            lease,
            on_cut=lambda: _cut_fleet(state),
            on_grown=state.lobby.freed,  # a client held for a slot its growth brings may go in
            acks=config.fleet_replica_acks,
        )
        stack.push_async_callback(member.close)
        if not await member.join(lease.policy.lease_s):
            log.warning(
                "event=fleet_join_failed url=%s then=%s hint=%r",
                member.url,
                config.fleet_unavailable,
                "admitting under --fleet-unavailable until Redis answers",
            )
        member.start()
        state.fleet = member

    async def _drain(self, state: ServerState) -> None:
        """New frames now yield with reason `draining`; wait for in-flight ones, then cancel the rest."""
        admission = state.admission
        admission.start_draining()
        state.lobby.answer_all()  # the frames held for their capacity are told `draining` too
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while admission.inflight.inflight and loop.time() < deadline and not self._skip_drain.is_set():
            await asyncio.sleep(0.01)
        if not admission.inflight.inflight:
            return
        leftovers = [r for c in state.connections if c.ingress for r in c.ingress.active.values()]
        log.warning("event=drain_timeout cancelling=%d", len(leftovers))
        for request in leftovers:
            state.lifecycle.cancel(request)  # the worker answers with done, finish_reason=cancelled
        deadline = loop.time() + CANCEL_GRACE_S
        while admission.inflight.inflight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for request in [r for r in leftovers if r.phase is not Phase.SETTLED]:
            state.lifecycle.lose(request, "shutdown: the worker did not confirm cancellation")
            request.owner.flush()


def _cut_fleet(state: ServerState) -> int:
    """The fleet lease's reservation ran out with no renewal: every request still running here is
    cancelled in its worker and fails `fleet_lease_lost` now, its slots freed, before Redis hands
    them to other replicas. Returns how many."""
    running = [r for c in state.connections if c.ingress for r in c.ingress.active.values()]
    for request in running:
        state.lifecycle.cancel(request)
        state.lifecycle.fail(request, FleetLeaseLost("the fleet lease lapsed past its reservation", request.client_id))
        request.owner.flush()  # a timer fired: no read will flush it
    return len(running)


def _close_connections(state: ServerState) -> None:
    for connection in list(state.connections):
        connection.close()
