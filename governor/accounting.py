"""Where every generate frame ends up: the conservation law the tests check.

    received == executed + yielded + rejected + failed + inflight

Plain ints and dicts (no locks, no prometheus objects) because the yield path increments them at
hundreds of thousands of frames per second; `metrics.py` reads them at scrape time.
"""

from __future__ import annotations

from enum import StrEnum

from governor.errors import ERRORS_BY_CODE, RequestFailed, RequestRejected
from governor.pool import YIELD_ENDPOINT_INFLIGHT, YIELD_ENDPOINT_QPS, YIELD_QPS

YIELD_INFLIGHT = "inflight"
YIELD_DRAINING = "draining"
YIELD_REASONS = (YIELD_INFLIGHT, YIELD_QPS, YIELD_ENDPOINT_INFLIGHT, YIELD_ENDPOINT_QPS, YIELD_DRAINING)
CLIENT_DISCONNECTED = "client_disconnected"
CONNECTION_SHED = "connection_shed"  # the governor closed the connection (see protocol.py)
REJECT_REASONS = tuple(code for code, cls in ERRORS_BY_CODE.items() if issubclass(cls, RequestRejected))
FAILURE_REASONS = (
    *(code for code, cls in ERRORS_BY_CODE.items() if issubclass(cls, RequestFailed)),
    CLIENT_DISCONNECTED,
    CONNECTION_SHED,
)


class Outcome(StrEnum):
    EXECUTED = "executed"
    YIELDED = "yielded"
    REJECTED = "rejected"
    FAILED = "failed"


class Accounting:
    __slots__ = ("received", "executed", "yielded", "rejected", "failed", "_by_outcome")

    def __init__(self) -> None:
        self.received = 0
        self.executed = 0
        # reason -> count. Known reasons start at 0 so every series exists from the first scrape
        # (rate() over a series that appears mid-way misses its first increments).
        self.yielded = dict.fromkeys(YIELD_REASONS, 0)
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.failed = dict.fromkeys(FAILURE_REASONS, 0)
        self._by_outcome = {Outcome.YIELDED: self.yielded, Outcome.REJECTED: self.rejected, Outcome.FAILED: self.failed}

    def record(self, outcome: Outcome, reason: str = "") -> None:
        if outcome is Outcome.EXECUTED:
            self.executed += 1
            return
        by_reason = self._by_outcome[outcome]
        by_reason[reason] = by_reason.get(reason, 0) + 1

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
