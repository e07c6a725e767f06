"""Every counter of the governor, written only through this class's methods.

Where every generate frame ends up is the conservation law the tests check:

    received == executed + yielded + rejected + failed + inflight

Token costs balance the same way: every admitted request's reserved cost is counted at
admission, and its real cost when it settles (`tokens_reserved`, `tokens_settled`).

Plain ints and dicts (no locks, no prometheus objects) because the yield path counts at hundreds
of thousands of frames per second; `metrics.py` reads them at scrape time. One method per event,
each a frame's or a request's single count, so no caller can count half of an event.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from governor.admission.tally import Tally
from govwire.errors import ERRORS_BY_CODE, GovernorError, RequestFailed, RequestRejected
from govwire.vocab import ErrorCode, Priority, YieldReason

if TYPE_CHECKING:
    from governor.admission.cost import Ask

CLIENT_DISCONNECTED = "client_disconnected"
CLIENT_CANCELLED = "client_cancelled"  # a `cancel` for a frame held in the lobby: it never ran
CONNECTION_SHED = "connection_shed"  # the governor closed the connection (see doors/connection.py)
REJECT_REASONS = tuple(code for code, cls in ERRORS_BY_CODE.items() if issubclass(cls, RequestRejected))
FAILURE_REASONS = (
    *(code for code, cls in ERRORS_BY_CODE.items() if issubclass(cls, RequestFailed)),
    CLIENT_DISCONNECTED,
    CLIENT_CANCELLED,
    CONNECTION_SHED,
)
# The failures that count against the endpoint a request ran on (governor_endpoint_failed_total):
# an error it sent, or one of its own making. `worker_lost` is counted where the link is lost
# (Lifecycle.lose), as a request lost there may still be re-routed and run elsewhere.
ENDPOINT_FAILURES = frozenset((ErrorCode.INTERNAL.value, ErrorCode.WORKER_UNAVAILABLE.value))

ANSWERS = ("admitted", "yielded")


class Outcome(StrEnum):
    EXECUTED = "executed"
    REJECTED = "rejected"
    FAILED = "failed"
    YIELDED = "yielded"  # admitted, then its endpoint answered 429/503 before it started: a late yield


def outcome_of(error: GovernorError) -> Outcome:
    """How an admitted request that ends in `error` is counted: rejected when the frame was at
    fault, failed otherwise."""
    return Outcome.REJECTED if isinstance(error, RequestRejected) else Outcome.FAILED


class ShedReason(StrEnum):
    """Why the governor closed a client connection (governor_connections_shed_total{reason})."""

    MAX_CONNECTIONS = "max_connections"
    IDLE = "idle_timeout"
    BUFFER = "buffer_bytes"
    WRITE_BUFFER = "write_buffer"
    UNAUTHORIZED = "unauthorized"
    BAD_REQUEST = "bad_request"  # HTTP front door: a request the parser cannot go on with (answered 4xx)
    SLOW_REQUEST = "slow_request"  # HTTP front door: headers and body not in within the request timeout


class DeadlineOutcome(StrEnum):
    """What became of an admitted request that carried `deadline_ms` (refusals are the yields with
    reason `deadline`)."""

    MET = "met"  # its first token came in time
    EXPIRED = "expired"  # cancelled at its deadline, without a first token


_EXECUTED = Outcome.EXECUTED  # a module global: read per request, cheaper than the enum's attribute


class Accounting:
    __slots__ = (
        "received",
        "http_received",
        "executed",
        "yielded",
        "final",
        "rejected",
        "failed",
        "rerouted",
        "worker_restarts",
        "shed",
        "tokens_reserved",
        "tokens_settled",
        "deadlines",
        "predictions",
        "classes",
        "first_admitted",
        "first_yielded",
        "retries",
        "blind_retries",
        "_by_outcome",
    )

    def __init__(self) -> None:
        self.received = 0
        # Of `received`, those that came through the HTTP front door (the rest are NDJSON frames):
        # counted once per request by doors/http.py, so the NDJSON hot path pays nothing.
        self.http_received = 0
        self.executed = 0
        # reason -> count. Known reasons start at 0 so every series exists from the first scrape
        # (rate() over a series that appears mid-way misses its first increments).
        self.yielded = {reason.value: 0 for reason in YieldReason}
        # Of the yields, those that told their client not to come back (past the promise horizon).
        self.final = {reason.value: 0 for reason in YieldReason}
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.failed = dict.fromkeys(FAILURE_REASONS, 0)
        self.rerouted = 0  # requests moved to another endpoint after theirs was lost
        self.worker_restarts = 0
        self.shed = {reason.value: 0 for reason in ShedReason}  # connections the governor closed, by reason
        self.tokens_reserved = 0  # token cost charged at admission, summed over admitted requests
        self.tokens_settled = 0  # their real cost, summed as they settle
        self.deadlines = {outcome.value: 0 for outcome in DeadlineOutcome}
        # Of the admitted requests with a deadline that the TTFT model predicted: whether the first
        # token came within the prediction (`covered`) or later, or never (`exceeded`).
        self.predictions = {"covered": 0, "exceeded": 0}
        self.classes = {priority: Tally() for priority in Priority}
        # Admission's answers by attempt: a retry is a frame back for its appointment or one whose
        # client says it retries; of those, the blind ones held no valid appointment. (First
        # attempts, the common case, in plain ints: the yield path counts them.)
        self.first_admitted = 0
        self.first_yielded = 0
        self.retries = dict.fromkeys(ANSWERS, 0)
        self.blind_retries = dict.fromkeys(ANSWERS, 0)
        self._by_outcome = {Outcome.REJECTED: self.rejected, Outcome.FAILED: self.failed, Outcome.YIELDED: self.yielded}

    # -- frames: each is counted once, with its fate -------------------------------------------------

    def frame_yielded(self, reason: str, ask: Ask, final: bool = False) -> None:
        """`reason`: a `YieldReason` value; `final`: the client was told not to come back."""
        self.received += 1
        self.yielded[reason] += 1
        if final:
            self.final[reason] += 1
        if ask.retry or ask.appointment is not None:
            self._retry(ask, "yielded")
        else:
            self.first_yielded += 1
        self.classes[ask.priority].yielded[reason] += 1
        if ask.tenant is not None:
            ask.tenant.tally.yielded[reason] += 1

    def frame_admitted(self, ask: Ask) -> None:
        """Received and admitted with its token cost reserved: it is in flight until `request_settled`."""
        self.received += 1
        self.tokens_reserved += ask.cost
        self.classes[ask.priority].admitted += 1
        if ask.retry or ask.appointment is not None:
            self._retry(ask, "admitted")
        else:
            self.first_admitted += 1
        if ask.tenant is not None:
            ask.tenant.tally.admitted += 1

    def _retry(self, ask: Ask, answer: str) -> None:
        self.retries[answer] += 1
        if ask.appointment is None:
            self.blind_retries[answer] += 1

    def frame_rejected(self, code: str) -> None:
        """Received and refused as invalid before admission (or the frame that hit a bug)."""
        self.received += 1
        self.rejected[code] = self.rejected.get(code, 0) + 1

    def frame_failed(self, reason: str) -> None:
        """Received and failed without being admitted (an internal error while reading it)."""
        self.received += 1
        self.failed[reason] = self.failed.get(reason, 0) + 1

    # -- admitted requests --------------------------------------------------------------------------

    def request_settled(self, ask: Ask, outcome: Outcome, reason: str = "", used_tokens: int = 0) -> None:
        """It ended, having really cost `used_tokens`."""
        self.tokens_settled += used_tokens
        executed = outcome is _EXECUTED
        self.classes[ask.priority].count_settled(executed, used_tokens)
        if ask.tenant is not None:
            ask.tenant.tally.count_settled(executed, used_tokens)
        if executed:
            self.executed += 1
            return
        by_reason = self._by_outcome[outcome]
        by_reason[reason] = by_reason.get(reason, 0) + 1
        if outcome is Outcome.YIELDED:  # a late yield (endpoint_busy, preempted) is a frame answered with yield
            self.classes[ask.priority].yielded[reason] += 1
            if ask.tenant is not None:
                ask.tenant.tally.yielded[reason] += 1

    def deadline(self, outcome: DeadlineOutcome, predicted_s: float | None, ttft_s: float) -> None:
        """An admitted request with a deadline started (`ttft_s` after it was received) or expired
        (`ttft_s`: how long it waited); `predicted_s`: what the deadline check predicted, if it did."""
        self.deadlines[outcome] += 1
        if predicted_s is not None:
            self.predictions["covered" if outcome is DeadlineOutcome.MET and ttft_s <= predicted_s else "exceeded"] += 1

    def request_rerouted(self) -> None:
        self.rerouted += 1

    # -- processes and connections ----------------------------------------------------------------

    def worker_restarted(self) -> None:
        self.worker_restarts += 1

    def connection_shed(self, reason: ShedReason) -> None:
        self.shed[reason] += 1

    # -- reading ----------------------------------------------------------------------------------

    @property
    def attempts(self) -> dict[str, dict[str, int]]:
        """Admission's answers by attempt (`ATTEMPTS`) and answer (`ANSWERS`)."""
        return {"first": {"admitted": self.first_admitted, "yielded": self.first_yielded}, "retry": dict(self.retries)}

    @property
    def yielded_total(self) -> int:
        return sum(self.yielded.values())

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def unbalanced_by(self, inflight: int) -> int:
        """0 when every received frame is accounted for; anything else is a bug."""
        settled = self.executed + self.yielded_total + self.rejected_total + self.failed_total
        return self.received - settled - inflight
