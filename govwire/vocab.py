"""Every word of protocol v1, declared once: ops, statuses, reserved ids, reasons, error codes.

The governor, the worker and the clients compare against these and write them; nothing else in
the code base spells them out. They are `StrEnum`s, so a member *is* its wire string (it compares
equal to, hashes like and serializes as the plain value), and a string read off the wire can be
looked up with `Op(text)`. docs/protocol.md describes each one.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

PROTOCOL_VERSION: Final = 1


class Op(StrEnum):
    """What a frame asks for (`op`); a frame without one is a `generate`."""

    GENERATE = "generate"
    PING = "ping"
    STATS = "stats"
    AUTH = "auth"  # the first frame when a shared secret is configured (auth.py)
    CANCEL = "cancel"  # stop an in-flight request: client -> governor, and governor -> worker


class Status(StrEnum):
    """What a reply says (`status`)."""

    ACCEPTED = "accepted"
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"
    YIELD = "yield"
    PONG = "pong"
    STATS = "stats"
    AUTHENTICATED = "authenticated"


FINAL_STATUSES: Final = frozenset({Status.DONE, Status.ERROR, Status.YIELD})
"""A request gets exactly one of these, as its last reply."""


class ReservedId(StrEnum):
    """Ids of link traffic that belongs to no request. Request ids the governor assigns on its
    worker links are hex strings, so these never collide with one."""

    STATS = "~stats"  # the engine statistics a worker pushes (messages.EngineStats)
    PING = "~ping"  # the governor's health ping on a worker link
    AUTH = "~auth"  # the auth frame that opens a link or a client connection


class YieldReason(StrEnum):
    """Which limit refused a frame (`reason` of a `yield`)."""

    INFLIGHT = "inflight"
    QPS = "qps"
    ENDPOINT_INFLIGHT = "endpoint_inflight"
    ENDPOINT_QPS = "endpoint_qps"
    TOKENS = "tokens"  # --max-inflight-tokens: the token cost held by admitted requests
    TOKEN_RATE = "token_rate"  # --max-tokens-per-s: the token cost admitted per second
    ENDPOINT_TOKENS = "endpoint_tokens"  # an endpoint's tokens=N
    ENDPOINT_BUSY = "endpoint_busy"  # an OpenAI-compatible endpoint answered 429/503: its Retry-After
    DEADLINE = "deadline"  # the predicted time to first token exceeds the frame's deadline_ms
    PREEMPTED = "preempted"  # admitted, then displaced before its first token by a higher class
    TENANT_INFLIGHT = "tenant_inflight"  # the tenant's max_inflight
    TENANT_QPS = "tenant_qps"  # the tenant's max_qps
    TENANT_TOKENS = "tenant_tokens"  # the tenant's max_inflight_tokens
    TENANT_TOKEN_RATE = "tenant_token_rate"  # the tenant's max_tokens_per_s
    TENANT_SHARE = "tenant_share"  # near saturation, the tenant is past its weighted share of recent service
    FLEET_INFLIGHT = "fleet_inflight"  # this replica's share of --fleet-max-inflight
    FLEET_QPS = "fleet_qps"  # its share of --fleet-max-qps
    FLEET_TOKENS = "fleet_tokens"  # its share of --fleet-max-inflight-tokens
    FLEET_TOKEN_RATE = "fleet_token_rate"  # its share of --fleet-max-tokens-per-s
    FLEET_UNAVAILABLE = "fleet_unavailable"  # no lease (Redis unreachable) and --fleet-unavailable closed
    DRAINING = "draining"


class Priority(StrEnum):
    """A generate frame's class (`priority`): how close to the hard caps it may be admitted. As
    saturation rises sheddable frames yield first, then standard ones; critical ones only at the
    hard cap (admission.PriorityCeilings)."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


DEFAULT_TENANT: Final = "default"
"""The tenant of every connection and frame that names no known tenant."""


class FinishReason(StrEnum):
    """Why a generation ended (`finish_reason` of a `done`)."""

    LENGTH = "length"
    EOS = "eos"
    CANCELLED = "cancelled"


class ErrorCode(StrEnum):
    """`code` of an `error` reply; errors.py maps each to one exception class."""

    BAD_JSON = "bad_json"
    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    INTEGRITY = "integrity"
    UNKNOWN_OP = "unknown_op"
    DUPLICATE_ID = "duplicate_id"
    UNAUTHORIZED = "unauthorized"
    WORKER_UNAVAILABLE = "worker_unavailable"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    IDLE_TIMEOUT = "idle_timeout"
    BUFFER_FULL = "buffer_full"
    OVER_BUDGET = "over_budget"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    FLEET_LEASE_LOST = "fleet_lease_lost"
    TENANT_MISMATCH = "tenant_mismatch"


MIB: Final = 1024 * 1024
MAX_REPLY_BYTES: Final = 64 * MIB
"""Longest reply line a reader accepts: a `done` carries the whole completion (the governor on its
worker links, and the clients)."""
WORKER_MAX_FRAME_BYTES: Final = 32 * MIB
"""Longest frame a worker reads."""
MAX_FRAME_BYTES_LIMIT: Final = WORKER_MAX_FRAME_BYTES // 2
"""The largest `--max-frame-bytes` a governor accepts: a forwarded frame is about as long as the
client's, so every frame the governor admits stays readable by its worker."""

WORKER_TOKEN_ENV: Final = "GOVERNOR_WORKER_TOKEN"
"""The per-run secret a spawned worker demands on every link, passed in its environment (which,
unlike argv, other users cannot read)."""

WORKER_EXIT_REPORT_ENV: Final = "GOVERNOR_WORKER_EXIT_REPORT"
"""A file a spawned worker writes one line to when it exits on an error: why (its supervisor puts
it in /readyz, `stats` and its log)."""

EXIT_STARTUP: Final = 2
"""A worker's exit code when it cannot start for a reason a restart will not change (a flag, the
model path, the dtype): its supervisor then waits minutes, not seconds, before trying again."""
