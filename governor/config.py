"""The governor's configuration: one frozen dataclass; the CLI is generated from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from governor.address import parse_address
from governor.options import option

MIB = 1024 * 1024
# The worker reads frames of up to 32 MiB (worker/service.py); a forwarded frame is at most about
# as long as the client's, so this cap keeps every admitted frame readable by the worker.
MAX_FRAME_BYTES_LIMIT = 16 * MIB


class ConfigError(ValueError):
    """Invalid configuration; the message names the setting."""


@dataclass(frozen=True)
class GovernorConfig:
    host: str = option("127.0.0.1", "address to listen on (also used by the metrics endpoint)")
    port: int = option(7070, "TCP port for NDJSON frames")
    metrics_port: int = option(9464, "port for /metrics, /healthz, /readyz; 0 disables the endpoint")
    max_inflight: int = option(32, "hard cap on admitted, unfinished generate requests")
    retry_hint: Literal["adaptive", "fixed"] = option(
        "adaptive", "adaptive: derive retry_hint_ms from observed service times; fixed: always the base value"
    )
    retry_hint_ms: float = option(50.0, "base retry hint, used before any service time is observed")
    retry_hint_min_ms: float = option(1.0, "lower clamp of retry_hint_ms")
    retry_hint_max_ms: float = option(10_000.0, "upper clamp of retry_hint_ms")
    max_frame_bytes: int = option(MIB, "longest accepted frame in bytes, newline excluded")
    max_new_tokens_limit: int = option(4096, "largest max_new_tokens a request may ask for")
    integrity: Literal["required", "optional", "off"] = option(
        "required", "size+sha256 of the prompt: required, optional (verified when present) or off"
    )
    drain_timeout_s: float = option(30.0, "on SIGTERM, how long in-flight requests may finish")
    worker: tuple[str, ...] = option(
        (),
        "connect to a running worker (unix:PATH or HOST:PORT) instead of spawning one; repeatable",
        metavar="ADDRESS",
    )
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log verbosity")
    worker_args: tuple[str, ...] = ()
    """Flags after `--`, passed to the spawned worker."""

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (0 <= self.port < 65536, "--port must be in [0, 65535]"),
            (0 <= self.metrics_port < 65536, "--metrics-port must be in [0, 65535]"),
            (self.max_inflight >= 1, "--max-inflight must be >= 1"),
            (self.retry_hint_ms > 0, "--retry-hint-ms must be > 0"),
            (
                0 < self.retry_hint_min_ms <= self.retry_hint_max_ms,
                "--retry-hint-min-ms must be > 0 and <= --retry-hint-max-ms",
            ),
            (
                64 <= self.max_frame_bytes <= MAX_FRAME_BYTES_LIMIT,
                f"--max-frame-bytes must be in [64, {MAX_FRAME_BYTES_LIMIT}]",
            ),
            (self.max_new_tokens_limit >= 1, "--max-new-tokens-limit must be >= 1"),
            (self.drain_timeout_s >= 0, "--drain-timeout-s must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.worker and self.worker_args:
            raise ConfigError("worker flags after -- only apply to a spawned worker; drop them or --worker")
        for text in self.worker:
            try:
                parse_address(text)
            except ValueError as exc:
                raise ConfigError(f"--worker: {exc}") from None
