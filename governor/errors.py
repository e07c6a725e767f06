"""One error family; each class maps to exactly one wire error `code`.

Two branches matter for accounting: a `RequestRejected` is the client's fault (bad input, never
reaches a worker), a `RequestFailed` is ours or the worker's (the request was valid). A
`ConnectionShed` answers no frame: it is the last reply on a connection the governor closes.
"""

from __future__ import annotations

from typing import ClassVar


class GovernorError(Exception):
    """Base of every error that becomes an `error` reply."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class RequestRejected(GovernorError):
    """The frame itself is at fault; retrying it unchanged cannot succeed."""


class RequestFailed(GovernorError):
    """The frame was fine; execution failed on our side."""


class ConnectionShed(GovernorError):
    """The governor closes this connection to protect the others; the reply is its last word."""


class BadJson(RequestRejected):
    code = "bad_json"


class BadFrame(RequestRejected):
    code = "bad_frame"


class FrameTooLarge(RequestRejected):
    code = "frame_too_large"


class IntegrityMismatch(RequestRejected):
    code = "integrity"


class UnknownOp(RequestRejected):
    code = "unknown_op"


class DuplicateId(RequestRejected):
    code = "duplicate_id"


class Unauthorized(RequestRejected):
    code = "unauthorized"


class WorkerUnavailable(RequestFailed):
    code = "worker_unavailable"


class WorkerLost(RequestFailed):
    code = "worker_lost"


class InternalError(RequestFailed):
    code = "internal"


class TooManyConnections(ConnectionShed):
    code = "too_many_connections"


class IdleTimeout(ConnectionShed):
    code = "idle_timeout"


class BufferFull(ConnectionShed):
    code = "buffer_full"


ERRORS_BY_CODE: dict[str, type[GovernorError]] = {
    cls.code: cls
    for cls in (
        BadJson,
        BadFrame,
        FrameTooLarge,
        IntegrityMismatch,
        UnknownOp,
        DuplicateId,
        Unauthorized,
        WorkerUnavailable,
        WorkerLost,
        InternalError,
        TooManyConnections,
        IdleTimeout,
        BufferFull,
    )
}


def error_from_code(code: str, message: str, request_id: str | None = None) -> GovernorError:
    """Rebuild the typed error from a wire `error` reply (unknown codes become `internal`)."""
    return ERRORS_BY_CODE.get(code, InternalError)(message, request_id)
