"""One error family; each class maps to exactly one wire error `code`.

Two branches matter for accounting: a `RequestRejected` is the client's fault (bad input, never
reaches a worker), a `RequestFailed` is ours or the worker's (the request was valid). A
`ConnectionShed` answers no frame: it is the last reply on a connection the governor closes.
"""

from __future__ import annotations

from typing import ClassVar

from govwire.vocab import ErrorCode


class GovernorError(Exception):
    """Base of every error that becomes an `error` reply."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, request_id: str | None = None, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        # The request field at fault, by its NDJSON name (the front door names it as OpenAI's
        # `param`, in the client's own words: `max_tokens` for `max_new_tokens`).
        self.field = field


class RequestRejected(GovernorError):
    """The frame itself is at fault; retrying it unchanged cannot succeed."""


class RequestFailed(GovernorError):
    """The frame was fine; execution failed on our side."""


class ConnectionShed(GovernorError):
    """The governor closes this connection to protect the others; the reply is its last word."""


class BadJson(RequestRejected):
    code = ErrorCode.BAD_JSON


class BadFrame(RequestRejected):
    code = ErrorCode.BAD_FRAME


class FrameTooLarge(RequestRejected):
    code = ErrorCode.FRAME_TOO_LARGE


class IntegrityMismatch(RequestRejected):
    code = ErrorCode.INTEGRITY


class UnknownOp(RequestRejected):
    code = ErrorCode.UNKNOWN_OP


class DuplicateId(RequestRejected):
    code = ErrorCode.DUPLICATE_ID


class Unauthorized(RequestRejected):
    code = ErrorCode.UNAUTHORIZED


class OverBudget(RequestRejected):
    """The request's token cost exceeds a whole budget: no wait would let it in."""

    code = ErrorCode.OVER_BUDGET


class TenantMismatch(RequestRejected):
    """The frame names a tenant other than the one its connection authenticated as."""

    code = ErrorCode.TENANT_MISMATCH


class WorkerUnavailable(RequestFailed):
    code = ErrorCode.WORKER_UNAVAILABLE


class WorkerLost(RequestFailed):
    code = ErrorCode.WORKER_LOST


class DeadlineExceeded(RequestFailed):
    """The frame's `deadline_ms` passed before its first token: the governor cancelled it."""

    code = ErrorCode.DEADLINE_EXCEEDED


class FleetLeaseLost(RequestFailed):
    """The replica lost its fleet lease (Redis out of reach) for longer than the fleet reserves
    what it held: the request was cancelled so the fleet's cap holds while others take its share."""

    code = ErrorCode.FLEET_LEASE_LOST


class InternalError(RequestFailed):
    code = ErrorCode.INTERNAL


class TooManyConnections(ConnectionShed):
    code = ErrorCode.TOO_MANY_CONNECTIONS


class IdleTimeout(ConnectionShed):
    code = ErrorCode.IDLE_TIMEOUT


class BufferFull(ConnectionShed):
    code = ErrorCode.BUFFER_FULL


ERRORS_BY_CODE: dict[str, type[GovernorError]] = {
    cls.code.value: cls
    for cls in (
        BadJson,
        BadFrame,
        FrameTooLarge,
        IntegrityMismatch,
        UnknownOp,
        DuplicateId,
        Unauthorized,
        OverBudget,
        TenantMismatch,
        WorkerUnavailable,
        WorkerLost,
        DeadlineExceeded,
        FleetLeaseLost,
        InternalError,
        TooManyConnections,
        IdleTimeout,
        BufferFull,
    )
}


def error_from_code(code: str, message: str, request_id: str | None = None) -> GovernorError:
    """Rebuild the typed error from a wire `error` reply (unknown codes become `internal`)."""
    return ERRORS_BY_CODE.get(code, InternalError)(message, request_id)
