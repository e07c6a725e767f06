"""How links judge their endpoints' health (worker_link.py, openai_link.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """A worker link pings every `ping_interval_s` and is cut when a ping goes unanswered for
    `ping_timeout_s` or its requests hear nothing for `stall_timeout_s`. An OpenAI-compatible
    endpoint is checked over HTTP at the same interval, with the same timeouts for a check and for
    a stream's silence."""

    ping_interval_s: float = 1.0
    ping_timeout_s: float = 5.0
    stall_timeout_s: float = 60.0
