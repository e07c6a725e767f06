"""The governor's configuration: one frozen dataclass; the CLI is generated from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from governor.admission.caps import Caps
from governor.admission.endpoint import OpenAITarget
from governor.admission.priority import CeilingPolicy, parse_allowance
from governor.admission.tenant import TenantLimits, parse_tenant
from governor.doors.gateway_policy import GatewayPolicy, parse_objective, parse_trusted
from governor.fleet.lease import FleetPolicy
from governor.fleet.redis_url import FleetRedis
from governor.shell.endpoints import parse_endpoint
from govwire.auth import PLACEHOLDER_PREFIX, SharedSecret, TenantSecrets
from govwire.logs import LogFormat
from govwire.options import ConfigError, option
from govwire.vocab import MAX_FRAME_BYTES_LIMIT, MIB, Priority

SDK_MAX_RETRY_AFTER_MS = 120_000
"""The longest `Retry-After` the OpenAI Python SDK honours (openai-python #3555): it treats a longer
one as not retryable. The front door never hints longer (checked against --promise-horizon-ms and
--retry-hint-max-ms when it is on)."""


@dataclass(frozen=True)
class GovernorConfig:
    host: str = option("127.0.0.1", "address to listen on (also used by the metrics endpoint)")
    port: int = option(7070, "TCP port for NDJSON frames")
    metrics_port: int = option(9464, "port for /metrics, /healthz, /readyz; 0 disables the endpoint")
    metrics_host: str = option("", "address of the metrics endpoint if not --host (e.g. 0.0.0.0 in a pod)")
    http_port: int = option(
        0, "TCP port of the OpenAI-compatible HTTP front door (POST /v1/completions, GET /v1/models); 0 = off"
    )
    http_request_timeout_s: float = option(
        10.0, "front door: a request's headers and body must arrive within this (else 408 and close)"
    )
    http_max_pipelined: int = option(
        16, "front door: pipelined requests held behind the one being answered; past it the socket is not read"
    )
    served_model: str = option(
        "gpt2", "the model name front-door clients send for the worker endpoints (GET /v1/models lists it)"
    )
    max_inflight: int = option(32, "hard cap on admitted, unfinished generate requests, over all workers")
    max_qps: float = option(0.0, "hard cap on admissions per second over all workers (a token bucket); 0 = none")
    qps_burst: float = option(0.0, "admissions the --max-qps bucket can bank; 0 = max(1, --max-qps)")
    max_inflight_tokens: int = option(
        0, "hard cap on the token cost (prompt + weighted max_new_tokens) held by admitted requests; 0 = none"
    )
    max_tokens_per_s: float = option(
        0.0, "hard cap on the token cost admitted per second (a bucket settled with real counts); 0 = none"
    )
    tokens_burst: float = option(
        0.0, "token cost the --max-tokens-per-s bucket can bank, and the most one request may cost; 0 = one second's"
    )
    output_token_weight: float = option(
        1.0, "what one requested output token (max_new_tokens) costs against the token caps, a prompt token costing 1"
    )
    bytes_per_token: float = option(
        4.0, "prompt UTF-8 bytes per token, to estimate prompts that declare no prompt_tokens (the starting value)"
    )
    token_estimate: Literal["calibrated", "fixed"] = option(
        "calibrated", "calibrated: learn --bytes-per-token from the prompt_tokens workers report; fixed: keep it"
    )
    deadline_margin: float = option(
        1.65,
        "a frame with deadline_ms is refused when the predicted time to first token plus a margin of standard"
        " deviations of the prediction's recent error exceeds it: the margin starts here and is learnt so that"
        " 5% of first tokens come later than predicted",
    )
    adaptive_limit: Literal["off", "shadow", "enforce"] = option(
        "off",
        "estimate the concurrency past which the engine's steps slow down more than they batch (its step time"
        " against its batch): shadow exports it (governor_adaptive_limit), enforce makes it the effective"
        " --max-inflight (which stays the ceiling)",
    )
    adaptive_limit_min: int = option(1, "the lowest limit --adaptive-limit enforce sets")
    adaptive_throughput: float = option(
        0.8,
        "--adaptive-limit: the knee is the smallest batch at which the engine's step-time line gives this share of"
        " its most throughput",
    )
    adaptive_slowdown: float = option(
        1.5,
        "--adaptive-limit: while the engine is slower than at its best, the limit comes below the knee until the"
        " step at the limit takes at most this times the step at the knee at its best",
    )
    tenant: tuple[str, ...] = option(
        (),
        "a tenant and its own caps; repeatable (or [[tenant]] tables in --config):"
        " NAME[,weight=W][,max_inflight=N][,max_qps=R][,qps_burst=B][,max_inflight_tokens=T]"
        "[,max_tokens_per_s=R][,tokens_burst=B]",
        metavar="TENANT",
    )
    tenant_from: Literal["auth", "frame", "header"] = option(
        "auth",
        "auth: a connection's tenant is the one its secret names in --auth-token-file (a frame naming another is"
        " refused); frame: each frame's tenant field (trusted clients); header: the front door's"
        " x-llm-d-inference-fairness-id (trusted clients; the NDJSON port as auth). Unknown or absent: the default"
        " tenant",
    )
    trusted_gateway: tuple[str, ...] = option(
        (),
        "an address or CIDR block of a gateway (llm-d, Envoy) whose x-llm-d-inference-fairness-id names the"
        " tenant of the requests it forwards to the front door; repeatable",
        metavar="CIDR",
    )
    objective: tuple[str, ...] = option(
        (),
        "NAME=critical|standard|sheddable: the class of front-door requests whose x-llm-d-inference-objective"
        " names this InferenceObjective; repeatable (an objective not listed is ignored)",
        metavar="NAME=CLASS",
    )
    priority_critical_from: int = option(
        1, "an integer x-dynamo-request-priority of at least this makes a request critical"
    )
    priority_sheddable_below: int = option(
        0, "an integer x-dynamo-request-priority below this makes a request sheddable (GAIE: negative)"
    )
    shed_blind_retries: bool = option(
        False,
        "retries without a valid appointment (x-stainless-retry-count > 0, a stale ticket) may fill only"
        " --sheddable-ceiling of each cap while a first attempt was refused capacity within --priority-hold-s",
    )
    tenant_share_from: float = option(
        0.8,
        "fraction of the global caps past which a tenant ahead of its weighted share of recent service yields"
        " (tenant_share) while another tenant contends; 1 = never",
    )
    sheddable_ceiling: float = option(
        0.8, "fraction of each cap sheddable frames may fill while higher classes are around"
    )
    standard_ceiling: float = option(
        0.95, "fraction of each cap standard frames may fill while critical ones are around"
    )
    class_allowance: tuple[str, ...] = option(
        (),
        "critical=D: critical frames are admitted past --max-inflight while fewer than it + D are in flight (a"
        " batch up to D larger while they use it), so a critical burst is not refused before anything frees",
        metavar="CLASS=D",
    )
    tenant_loan: int = option(
        0,
        "a tenant under its fair share that meets the full --max-inflight is lent up to N slots past it while"
        " the tenants over their shares hold as many (a quiet tenant beside a flood; the flood pays them back);"
        " 0: never, the cap is hard for every tenant",
        metavar="N",
    )
    priority_hold_s: float = option(
        1.0,
        "a class ceiling applies this long (at least one release gap) after a higher-class frame was"
        " refused capacity, or until its appointment is due",
    )
    preempt: Literal["on", "off"] = option(
        "on",
        "a frame of a higher class that meets the full in-flight cap displaces a lower-class request"
        " that has not streamed a token (yield `preempted`, with a hint and an appointment)",
    )
    fleet: str = option(
        "",
        "redis://[[USER]:PASSWORD@]HOST:PORT/DB (rediss:// for TLS), or redis+sentinel://HOST:PORT[,...]/SERVICE"
        " (the primary Redis Sentinel names): share the --fleet-* caps with every governor using this Redis and"
        " --fleet-name, each enforcing a lease renewed in the background",
        metavar="URL",
    )
    fleet_name: str = option("governor", "the fleet's key prefix in Redis: replicas with the same name share caps")
    fleet_max_inflight: int = option(0, "hard cap on admitted, unfinished requests over the whole fleet; 0 = none")
    fleet_max_qps: float = option(0.0, "hard cap on admissions per second over the whole fleet; 0 = none")
    fleet_promises: Literal["on", "off"] = option(
        "off",
        "on: this replica's share of --fleet-max-inflight books the clients it refuses (their slot kept, a"
        " renewal never shrinks the share below what they count on); off: its hints are estimates. Opt-in: a"
        " replica cut off and healed may wait for a share while the others' are kept for their promises",
    )
    fleet_qps_burst: float = option(0.0, "admissions the fleet's --fleet-max-qps can bank; 0 = one second's")
    fleet_max_inflight_tokens: int = option(
        0, "hard cap on the token cost held by admitted requests over the whole fleet; 0 = none"
    )
    fleet_max_tokens_per_s: float = option(
        0.0, "hard cap on the token cost admitted per second over the fleet; 0 = none"
    )
    fleet_tokens_burst: float = option(
        0.0, "token cost the fleet's --fleet-max-tokens-per-s can bank; 0 = one second's"
    )
    fleet_renew_ms: float = option(250.0, "how often this replica renews its lease (its share of each fleet cap)")
    fleet_lease_ms: float = option(
        1000.0, "a lease not renewed for this long lapses (then --fleet-unavailable applies)"
    )
    fleet_unavailable: Literal["hold", "closed", "local"] = option(
        "hold",
        "once the lease lapsed (Redis out of reach): hold admits within the last shares for --fleet-hold-s, then"
        " closes; closed yields every frame (fleet_unavailable); local enforces each fleet cap / the last known"
        " replica count, unreserved: the fleet may exceed its caps while others still reach Redis",
    )
    fleet_hold_s: float = option(
        10.0,
        "with --fleet-unavailable hold: how long a lapsed replica admits within its last shares (Redis keeps them"
        " reserved that long): size it to your Redis failover time",
    )
    fleet_replica_acks: int = option(
        0,
        "Redis replicas that must have a renewal (WAIT) before a share it grew is applied, so that a failover"
        " cannot lose a grant in use; 0 = none (a failover may lose the last renewals' growth)",
    )
    fleet_max_request_s: float = option(
        30.0,
        "what a lapsed replica admitted stays reserved in Redis this long after its lease (and hold) ran out;"
        " requests still running then are cancelled (fleet_lease_lost). A dead replica's share returns after"
        " 1.5 x lease + hold + this",
    )
    retry_hint: Literal["adaptive", "fixed"] = option(
        "adaptive",
        "adaptive: hints from the release forecast, with appointments; fixed: the base value for every capacity"
        " limit (the exact waits of buckets, an endpoint's Retry-After and lease renewals stay)",
    )
    retry_hint_ms: float = option(50.0, "base retry hint, used before any service time is observed")
    retry_hint_min_ms: float = option(1.0, "lower clamp of retry_hint_ms")
    retry_hint_max_ms: float = option(
        10_000.0,
        "upper clamp of retry_hint_ms (raised to the promise horizon); with --http-port at most 120000, the"
        " longest Retry-After the OpenAI SDKs honour",
    )
    promise_horizon_ms: float = option(
        1000.0,
        "a refused client is promised a slot only when one frees within this long; beyond it the refusal"
        " is final (HTTP x-should-retry: false, NDJSON final: true). Short for interactive callers, past"
        " the drain time of a burst for batch jobs",
    )
    appointment_grace_ms: float = option(
        50.0,
        "width of the window around a refused client's appointment in which the capacity it was"
        " promised is kept for it (a no-show idles it at most this long)",
    )
    max_frame_bytes: int = option(MIB, "longest accepted frame in bytes, newline excluded")
    max_new_tokens_limit: int = option(4096, "largest max_new_tokens a request may ask for")
    integrity: Literal["required", "optional", "off"] = option(
        "required", "NDJSON port: size+sha256 of the prompt: required, optional (verified when present) or off"
    )
    http_integrity: Literal["required", "optional", "off"] = option(
        "optional",
        "front door: the body's Content-Digest (sha-256): optional (verified when present; the OpenAI SDKs send"
        " none), required or off",
    )
    drain_timeout_s: float = option(30.0, "on SIGTERM, how long in-flight requests may finish")
    max_connections: int = option(10_000, "client connections held at once; one more is refused (too_many_connections)")
    idle_timeout_s: float = option(
        300.0, "close a connection with nothing in flight that sent no line for this long; 0 = never"
    )
    max_buffer_bytes: int = option(
        256 * MIB, "unfinished-frame bytes held over all connections; past it the biggest holder is shed"
    )
    max_write_buffer_bytes: int = option(
        8 * MIB, "unread reply bytes queued for one client that stopped reading; past it the connection is cut"
    )
    auth_token_file: str = option(
        "",
        "file of client secrets, one per line: SECRET, or TENANT SECRET to name the tenant its connections act"
        " as; every connection must then open with an auth frame. SIGHUP re-reads it",
        metavar="PATH",
    )
    worker_auth_token_file: str = option(
        "",
        "secret the --worker endpoints expect (their --auth-token-file); spawned workers get one per run",
        metavar="PATH",
    )
    worker: tuple[str, ...] = option(
        (),
        "connect to a running worker instead of spawning one; repeatable. Soft caps may follow the address:"
        " ADDRESS[,concurrency=N][,tokens=T][,qps=R][,burst=B][,weight=W]. An http(s)://HOST:PORT/v1 address"
        " is an OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI, transformers serve) and needs"
        " ,model=NAME (and ,api_key_file=PATH if it wants a key)",
        metavar="ENDPOINT",
    )
    workers: int = option(
        1, "local workers to spawn when no --worker is given; with several, worker i sees GPU i (CUDA_VISIBLE_DEVICES)"
    )
    worker_ping_interval_s: float = option(1.0, "how often each worker link is pinged; an endpoint is up once answered")
    worker_ping_timeout_s: float = option(
        5.0, "a worker link whose ping stays unanswered this long is cut, its requests failing with worker_lost"
    )
    worker_stall_timeout_s: float = option(
        60.0, "a worker with requests in flight that sends none of them anything for this long is declared lost"
    )
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log verbosity")
    log_format: LogFormat = option(
        "logfmt", "log lines as logfmt (key=value) or as JSON objects; a spawned worker logs the same way"
    )
    config: str = option(
        "", "TOML file of settings and [[endpoint]] tables; flags win; SIGHUP re-reads its caps", metavar="PATH"
    )
    worker_args: tuple[str, ...] = ()
    """Flags after `--`, passed to the spawned worker."""
    flag_overrides: tuple[str, ...] = ()
    """Fields given as flags: a reloaded config file does not change them."""

    def __post_init__(self) -> None:
        """Refuse a configuration that cannot run, naming the flag to change. Each setting's range
        first, in four tables read in one order (a later check may lean on an earlier one: a bound
        read against another setting comes after that setting's own check); then what reading the
        secret files and parsing the endpoints, tenants, classes, gateways and fleet finds."""
        ranges = (*self._listener_ranges(), *self._admission_ranges(), *self._process_ranges(), *self._cost_ranges())
        for ok, message in ranges:
            if not ok:
                raise ConfigError(message)
        self.client_secret()
        self.worker_secret()
        self._check_worker_source()
        self._check_endpoints()
        self.tenant_limits()
        self.ceiling_policy()
        self.gateway_policy()
        self._check_fleet()

    def _listener_ranges(self) -> list[tuple[bool, str]]:
        """The ports and the front door's own limits: (holds, the message when it does not)."""
        return [
            (0 <= self.port < 65536, "--port must be in [0, 65535]"),
            (0 <= self.metrics_port < 65536, "--metrics-port must be in [0, 65535]"),
            (0 <= self.http_port < 65536, "--http-port must be in [0, 65535]"),
            (self.http_request_timeout_s > 0, "--http-request-timeout-s must be > 0"),
            (self.http_max_pipelined >= 1, "--http-max-pipelined must be >= 1"),
            (bool(self.served_model.strip()), "--served-model must not be empty"),
        ]

    def _admission_ranges(self) -> list[tuple[bool, str]]:
        """The in-flight cap, the hints and promises, and what one frame may ask. The front door's
        bound on them comes last: it compares the hint bounds checked just before it."""
        return [
            (self.max_inflight >= 1, "--max-inflight must be >= 1"),
            (self.tenant_loan >= 0, "--tenant-loan must be >= 0"),
            (self.retry_hint_ms > 0, "--retry-hint-ms must be > 0"),
            (self.appointment_grace_ms > 0, "--appointment-grace-ms must be > 0"),
            (self.promise_horizon_ms > 0, "--promise-horizon-ms must be > 0"),
            (
                0 < self.retry_hint_min_ms <= self.retry_hint_max_ms,
                "--retry-hint-min-ms must be > 0 and <= --retry-hint-max-ms",
            ),
            (
                64 <= self.max_frame_bytes <= MAX_FRAME_BYTES_LIMIT,
                f"--max-frame-bytes must be in [64, {MAX_FRAME_BYTES_LIMIT}]",
            ),
            (self.max_new_tokens_limit >= 1, "--max-new-tokens-limit must be >= 1"),
            (
                not self.http_port or max(self.promise_horizon_ms, self.retry_hint_max_ms) <= SDK_MAX_RETRY_AFTER_MS,
                f"with --http-port, --promise-horizon-ms and --retry-hint-max-ms must be <= {SDK_MAX_RETRY_AFTER_MS}:"
                " the OpenAI SDKs give up on a longer Retry-After",
            ),
        ]

    def _process_ranges(self) -> list[tuple[bool, str]]:
        """The drain, the rate cap, the workers, the connections and their buffers, and the workers'
        health checks. The buffer must hold a whole frame: it comes after --max-frame-bytes."""
        return [
            (self.drain_timeout_s >= 0, "--drain-timeout-s must be >= 0"),
            (
                math.isfinite(self.max_qps + self.qps_burst) and self.max_qps >= 0 and self.qps_burst >= 0,
                "--max-qps and --qps-burst must be finite and >= 0",
            ),
            (self.workers >= 1, "--workers must be >= 1"),
            (self.max_connections >= 1, "--max-connections must be >= 1"),
            (0 <= self.idle_timeout_s < math.inf, "--idle-timeout-s must be finite and >= 0"),
            (self.max_buffer_bytes >= self.max_frame_bytes, "--max-buffer-bytes must be >= --max-frame-bytes"),
            (self.max_write_buffer_bytes >= 64 * 1024, "--max-write-buffer-bytes must be >= 65536"),
            (0 < self.worker_stall_timeout_s < math.inf, "--worker-stall-timeout-s must be finite and > 0"),
            (
                0 < self.worker_ping_interval_s <= self.worker_ping_timeout_s < math.inf,
                "--worker-ping-interval-s must be > 0 and <= --worker-ping-timeout-s",
            ),
        ]

    def _cost_ranges(self) -> list[tuple[bool, str]]:
        """The bursts and token caps, what a token costs, the deadline margin, the adaptive limit
        and the tenants' shares. A burst of 0 means the default, so it is checked apart from the
        rate's own range above; the adaptive floor lies under --max-inflight, checked before."""
        return [
            (not self.qps_burst or self.qps_burst >= 1, "--qps-burst must be >= 1 (or 0 for the default)"),
            (self.max_inflight_tokens >= 0, "--max-inflight-tokens must be >= 0"),
            (
                math.isfinite(self.max_tokens_per_s + self.tokens_burst)
                and self.max_tokens_per_s >= 0
                and (not self.tokens_burst or self.tokens_burst >= 1),
                "--max-tokens-per-s must be finite and >= 0, --tokens-burst >= 1 (or 0 for the default)",
            ),
            (
                0 <= self.output_token_weight < math.inf and 0 < self.bytes_per_token < math.inf,
                "--output-token-weight must be finite and >= 0, --bytes-per-token finite and > 0",
            ),
            (0 <= self.deadline_margin < math.inf, "--deadline-margin must be finite and >= 0"),
            (
                1 <= self.adaptive_limit_min <= self.max_inflight,
                "--adaptive-limit-min must be in [1, --max-inflight]",
            ),
            (0 < self.adaptive_throughput < 1, "--adaptive-throughput must be in (0, 1)"),
            (1 <= self.adaptive_slowdown < math.inf, "--adaptive-slowdown must be finite and >= 1"),
            (0 <= self.tenant_share_from <= 1, "--tenant-share-from must be in [0, 1]"),
        ]

    def _check_worker_source(self) -> None:
        """Workers come either from --worker endpoints or spawned by --workers, never both: a flag
        meant for one kind would be silently ignored by the other."""
        if self.worker_auth_token_file and not self.worker:
            raise ConfigError("--worker-auth-token-file is for --worker endpoints; spawned ones get a per-run secret")
        if self.worker and self.workers > 1:
            raise ConfigError("--workers spawns local workers; it cannot be combined with --worker endpoints")
        if self.worker and self.worker_args:
            raise ConfigError("worker flags after -- only apply to a spawned worker; drop them or --worker")

    def _check_endpoints(self) -> None:
        """Every --worker parses, its API key file reads, and none is listed twice: an endpoint's
        address is its name (in the pool, the metrics and a reload's matching)."""
        seen: set[str] = set()
        for text in self.worker:
            try:
                target = parse_endpoint(text)[0]
                if isinstance(target, OpenAITarget) and target.api_key_file:
                    SharedSecret.read(target.api_key_file)
            except (ValueError, OSError) as exc:
                raise ConfigError(f"--worker {text!r}: {exc}") from None
            address = str(target)
            if address in seen:
                raise ConfigError(f"--worker {address} is listed twice")
            seen.add(address)

    def _check_fleet(self) -> None:
        """--fleet and the fleet caps come together (a cap with no Redis to share it through, or
        a Redis with nothing to share, is a mistake, not a default), and its URL parses with a
        password that is not the shipped placeholder."""
        policy = self.fleet_policy()
        if self.fleet and not policy.any:
            raise ConfigError("--fleet needs a fleet cap: --fleet-max-inflight, --fleet-max-qps or a token one")
        if policy.any and not self.fleet:
            raise ConfigError("the --fleet-max-* caps are shared through Redis: give its --fleet URL")
        if self.fleet_replica_acks < 0:
            raise ConfigError("--fleet-replica-acks must be >= 0")
        if self.fleet:
            try:
                password = FleetRedis.parse(self.fleet).password or ""
            except ValueError as exc:  # e.g. an unclosed [IPv6] host
                raise ConfigError(f"--fleet: {exc}") from None
            if password.startswith(PLACEHOLDER_PREFIX):
                raise ConfigError("--fleet: the password is the shipped placeholder (replace-me…); create a random one")

    def gateway_policy(self) -> GatewayPolicy:
        """How far the front door trusts gateway headers, and how their priorities map to classes."""
        try:
            trusted = tuple(parse_trusted(text) for text in self.trusted_gateway)
            objectives = dict(parse_objective(text) for text in self.objective)
            return GatewayPolicy(
                self.tenant_from == "header",
                trusted,
                objectives,
                self.priority_critical_from,
                self.priority_sheddable_below,
            )
        except ValueError as exc:
            raise ConfigError(f"--trusted-gateway, --objective, --priority-*: {exc}") from None

    @property
    def caps(self) -> Caps:
        """The governor's own caps (--max-inflight, --max-qps, ...)."""
        return Caps(
            max_inflight=self.max_inflight,
            max_qps=self.max_qps,
            qps_burst=self.qps_burst,
            max_inflight_tokens=self.max_inflight_tokens,
            max_tokens_per_s=self.max_tokens_per_s,
            tokens_burst=self.tokens_burst,
        )

    def fleet_policy(self) -> FleetPolicy:
        try:
            return FleetPolicy(
                max_inflight=self.fleet_max_inflight,
                max_qps=self.fleet_max_qps,
                qps_burst=self.fleet_qps_burst,
                max_inflight_tokens=self.fleet_max_inflight_tokens,
                max_tokens_per_s=self.fleet_max_tokens_per_s,
                tokens_burst=self.fleet_tokens_burst,
                renew_s=self.fleet_renew_ms / 1000,
                lease_s=self.fleet_lease_ms / 1000,
                unavailable=self.fleet_unavailable,
                hold_s=self.fleet_hold_s,
                max_request_s=self.fleet_max_request_s,
            )
        except ValueError as exc:
            raise ConfigError(f"--fleet-*: {exc}") from None

    def tenant_limits(self) -> dict[str, TenantLimits]:
        """The tenants with limits of their own, by name."""
        tenants: dict[str, TenantLimits] = {}
        for text in self.tenant:
            try:
                name, limits = parse_tenant(text)
            except ValueError as exc:
                raise ConfigError(f"--tenant {text!r}: {exc}") from None
            if name in tenants:
                raise ConfigError(f"--tenant {name} is listed twice")
            tenants[name] = limits
        return tenants

    def ceiling_policy(self) -> CeilingPolicy:
        try:
            allowances = dict(parse_allowance(text) for text in self.class_allowance)
        except ValueError as exc:
            raise ConfigError(f"--class-allowance: {exc}") from None
        try:
            return CeilingPolicy(
                self.sheddable_ceiling,
                self.standard_ceiling,
                self.priority_hold_s,
                allowances.get(Priority.CRITICAL, 0),
            )
        except ValueError as exc:
            raise ConfigError(f"--sheddable-ceiling, --standard-ceiling, --priority-hold-s: {exc}") from None

    def client_secret(self) -> TenantSecrets | None:
        """The client secrets and the tenants they name (read again on every call: SIGHUP rotates them)."""
        if not self.auth_token_file:
            return None
        try:
            return TenantSecrets.read(self.auth_token_file)
        except ValueError as exc:
            raise ConfigError(f"--auth-token-file: {exc}") from None

    def worker_secret(self) -> SharedSecret | None:
        return _secret(self.worker_auth_token_file, "--worker-auth-token-file")


def _secret(path: str, flag: str) -> SharedSecret | None:
    if not path:
        return None
    try:
        return SharedSecret.read(path)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
