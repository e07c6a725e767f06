"""Server lifecycle: start the worker link(s), listen, wait for a signal, drain, exit 0."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import resource
import shutil
import signal
import tempfile
import time

from governor.address import Address
from governor.admission import InflightLimiter, RetryHintEstimator, RetryHintPolicy
from governor.auth import SharedSecret
from governor.config import ConfigError, GovernorConfig, parse_endpoint
from governor.config_file import reload_config
from governor.metrics import build_registry
from governor.metrics_server import MetricsEndpoint
from governor.pool import Endpoint, EndpointLimits, Pool
from governor.protocol import ConnectionLimits, GovernorProtocol
from governor.state import ServerState
from governor.supervisor import WORKER_TOKEN_ENV, WorkerSupervisor
from governor.upstream import HealthPolicy, Upstream, WorkerLink
from governor.validation import IntegrityMode, Limits

log = logging.getLogger("governor.server")

CANCEL_GRACE_S = 1.0  # after the drain deadline, how long the worker gets to confirm cancels
TIMEOUT_SWEEP_MAX_S = 1.0  # idle and unauthenticated connections are looked for at least this often


def build_state(config: GovernorConfig, upstream: Upstream, now: float) -> ServerState:
    policy = RetryHintPolicy(
        base_ms=config.retry_hint_ms,
        min_ms=config.retry_hint_min_ms,
        max_ms=config.retry_hint_max_ms,
        adaptive=config.retry_hint == "adaptive",
    )
    return ServerState(
        limits=Limits(max_new_tokens=config.max_new_tokens_limit, integrity=IntegrityMode(config.integrity)),
        limiter=InflightLimiter(config.max_inflight),
        pool=Pool(
            [link.endpoint for link in upstream.links], config.max_qps, config.qps_burst, config.max_inflight, now
        ),
        hints=RetryHintEstimator(policy, config.max_inflight),
        upstream=upstream,
        auth=config.client_secret(),
    )


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
    """Close connections past their auth deadline or idle timeout (protocol.py decides)."""
    interval = min(TIMEOUT_SWEEP_MAX_S, idle_timeout_s / 4) if idle_timeout_s else TIMEOUT_SWEEP_MAX_S
    while True:
        await asyncio.sleep(interval)
        now = state.clock()
        for connection in list(state.connections):
            connection.check_timeouts(now)


RELOADABLE = ("max_inflight", "max_qps", "qps_burst", "worker")


def apply_caps(state: ServerState, config: GovernorConfig, now: float) -> None:
    """Live cap changes. Lowering a cap never cancels a running request: it stops new admissions
    until in-flight falls under it. Endpoints are matched by address; adding or removing one
    needs a restart."""
    state.limiter.max_inflight = config.max_inflight
    state.hints.set_capacity(config.max_inflight)
    state.pool.set_global(config.max_qps, config.qps_burst, config.max_inflight, now)
    endpoints = {e.name: e for e in state.pool.endpoints}
    for address, limits in (parse_endpoint(text) for text in config.worker):
        endpoint = endpoints.pop(str(address), None)
        if endpoint is None:
            log.warning("event=reload_endpoint_ignored address=%s reason=endpoints_change_on_restart", address)
        else:
            endpoint.set_limits(limits, now)
    for name in endpoints:  # in the running pool but no longer in the file: kept as they are
        log.warning("event=reload_endpoint_kept address=%s reason=endpoints_change_on_restart", name)


def gpu_assignment(workers: int, visible: str | None) -> list[str | None]:
    """One GPU per spawned worker when there are several: worker i sees the i-th visible device
    (of CUDA_VISIBLE_DEVICES when set, else GPU i), round-robin if there are fewer devices. A
    single worker keeps the environment as it is."""
    if workers == 1:
        return [None]
    if visible is None:
        devices = [str(i) for i in range(workers)]
    else:  # "" hides every GPU: keep it hidden
        devices = [d.strip() for d in visible.split(",") if d.strip()] or [""]
    return [devices[i % len(devices)] for i in range(workers)]


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
        """SIGHUP: re-read the config file and apply its caps; nothing running is touched."""
        try:
            new = reload_config(self.config)
        except ConfigError as exc:
            log.error("event=reload_failed error=%r", str(exc))
            return
        apply_caps(state, new, time.monotonic())
        caps = {name: getattr(new, name) for name in RELOADABLE}
        ignored = [
            name for name, value in vars(new).items() if name not in RELOADABLE and value != getattr(self.config, name)
        ]
        if ignored:
            log.warning("event=reload_needs_restart settings=%s", ",".join(ignored))
        self.config = dataclasses.replace(self.config, **caps)
        log.info("event=reloaded max_inflight=%d max_qps=%g endpoints=%s", new.max_inflight, new.max_qps, new.worker)

    async def serve(self) -> int:
        config = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

        runtime_dir: str | None = None
        supervisors: list[WorkerSupervisor] = []
        now = time.monotonic()
        if config.worker:
            specs = [parse_endpoint(text) for text in config.worker]
        else:
            runtime_dir = tempfile.mkdtemp(prefix="governor-")  # mode 0700: the worker sockets are ours alone
            sockets = [os.path.join(runtime_dir, f"worker-{i}.sock") for i in range(config.workers)]
            specs = [(Address(path=path), EndpointLimits()) for path in sockets]
        # Spawned workers accept only links that present this run's secret (passed in their environment).
        worker_secret = config.worker_secret() if config.worker else SharedSecret.generate()
        health = HealthPolicy(
            config.worker_ping_interval_s, config.worker_ping_timeout_s, config.worker_stall_timeout_s
        )
        upstream = Upstream(
            [(address, Endpoint(str(address), limits, now)) for address, limits in specs], health, worker_secret
        )
        state = build_state(config, upstream, now)
        if config.config:
            loop.add_signal_handler(signal.SIGHUP, self.reload, state)
        if runtime_dir is not None:
            devices = gpu_assignment(config.workers, os.environ.get("CUDA_VISIBLE_DEVICES"))
            assert worker_secret is not None  # generated above for spawned workers
            supervisors = [
                self._spawn_worker(link, state, device, worker_secret)
                for link, device in zip(upstream.links, devices, strict=True)
            ]

        metrics: MetricsEndpoint | None = None
        max_open_files = raise_fd_limit()
        if state.auth is None and not is_loopback(config.host):
            log.warning(
                "event=unauthenticated_bind host=%s hint=%r",
                config.host,
                "anyone who can reach this address can submit work; set --auth-token-file",
            )
        tasks: list[asyncio.Task[None]] = []
        try:
            upstream.start()
            tasks.append(asyncio.create_task(sweep_timeouts(state, config.idle_timeout_s)))
            if config.metrics_port:
                metrics = MetricsEndpoint(build_registry(state), is_ready=lambda: upstream.num_up > 0)
                await metrics.start(config.metrics_host or config.host, config.metrics_port)
            limits = connection_limits(config)
            listener = await loop.create_server(
                lambda: GovernorProtocol(state, limits), config.host, config.port, backlog=1024
            )
            log.info(
                "event=listening host=%s port=%d metrics_port=%d max_inflight=%d max_open_files=%d workers=%s",
                config.host,
                config.port,
                config.metrics_port,
                config.max_inflight,
                max_open_files,
                ",".join(link.address for link in upstream.links),
            )
            await self._stop.wait()
            log.info("event=draining inflight=%d timeout_s=%.1f", state.limiter.inflight, config.drain_timeout_s)
            listener.close()
            await self._drain(state)
        finally:
            for task in tasks:
                task.cancel()
            for connection in list(state.connections):
                connection.close()
            await upstream.close()
            for supervisor in supervisors:
                await supervisor.stop()
            if metrics is not None:
                await metrics.close()
            if runtime_dir is not None:
                shutil.rmtree(runtime_dir, ignore_errors=True)
        log.info("event=stopped executed=%d", state.accounting.executed)
        return 0

    def _spawn_worker(
        self, link: WorkerLink, state: ServerState, device: str | None, secret: SharedSecret
    ) -> WorkerSupervisor:
        def on_spawn(pid: int) -> None:
            link.pid = pid

        def on_restart() -> None:
            state.worker_restarts += 1

        env = {**os.environ, WORKER_TOKEN_ENV: secret.token.decode()}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        supervisor = WorkerSupervisor(link.address, list(self.config.worker_args), on_spawn, on_restart, env)
        link.kill_worker = supervisor.kill
        supervisor.start()
        return supervisor

    async def _drain(self, state: ServerState) -> None:
        """New frames now yield with reason `draining`; wait for in-flight ones, then cancel the rest."""
        state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while state.limiter.inflight and loop.time() < deadline and not self._skip_drain.is_set():
            await asyncio.sleep(0.01)
        if not state.limiter.inflight:
            return
        leftovers = [r for c in state.connections if c.ingress for r in c.ingress.active.values()]
        log.warning("event=drain_timeout cancelling=%d", len(leftovers))
        for request in leftovers:
            state.upstream.cancel(request)  # the worker answers with done, finish_reason=cancelled
        deadline = loop.time() + CANCEL_GRACE_S
        while state.limiter.inflight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for request in [r for r in leftovers if not r.settled]:
            request.owner.worker_lost(request, "shutdown: the worker did not confirm cancellation")
            request.owner.flush()
