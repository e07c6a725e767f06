"""The worker's configuration: one frozen dataclass; `worker serve` flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from governor.address import parse_address
from governor.config import ConfigError
from governor.options import option


@dataclass(frozen=True)
class WorkerConfig:
    listen: str = option("127.0.0.1:7071", "where to accept governor links: unix:PATH or HOST:PORT")
    engine: Literal["echo"] = option("echo", "what generates tokens")
    token_delay_ms: float = option(0.0, "echo: delay between consecutive tokens")
    first_token_delay_ms: float = option(0.0, "echo: delay before the first token")
    parent_pid: int = option(0, "exit when this process is gone (set by a spawning governor); 0 = never")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log verbosity")

    def __post_init__(self) -> None:
        try:
            parse_address(self.listen)
        except ValueError as exc:
            raise ConfigError(f"--listen: {exc}") from None
        if self.token_delay_ms < 0 or self.first_token_delay_ms < 0:
            raise ConfigError("--token-delay-ms and --first-token-delay-ms must be >= 0")
