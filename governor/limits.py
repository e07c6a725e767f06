"""What a limit on admission is, and the limits that apply to a request as a whole.

A `Limit` answers four questions about one request, each without I/O and with the clock passed
in: may it go now (`check`, which charges nothing: a refusal leaves no trace on any capacity), take what it
costs (`charge`), give back a charge that was never used (`refund`: the frame turned out invalid
after its admission), and give back what a running request holds once it has ended (`release`).
A refusal names its reason and its hint: how long the refused client should wait.

`admission.Admission` checks every limit before it charges any, so admission is all-or-nothing;
in a single-threaded event loop nothing can happen between the checks and the charges. Each new
kind of limit (token budgets, tenant caps, class ceilings, fleet leases) is one more `Limit`.
"""

from __future__ import annotations

import math
from typing import Protocol

from governor.buckets import make_bucket, updated_bucket
from governor.endpoint import Endpoint
from governor.hints import RetryHintEstimator
from govwire.vocab import YieldReason


class Refusal:
    """A `yield`: which limit refused (a `YieldReason`'s value) and the retry hint it computed
    (ms, >= 1).

    Each limit owns one and refills it on every refusal (the yield path runs for every refused
    frame, and allocating an object there costs more than the rest of the decision): read it
    before asking the same limit again.
    """

    __slots__ = ("reason", "hint_ms")

    def __init__(self, reason: YieldReason, hint_ms: int = 1) -> None:
        self.reason: str = reason.value  # a plain str: it is a dict key and a JSON value per frame
        self.hint_ms = hint_ms

    def at(self, hint_ms: int) -> Refusal:
        self.hint_ms = hint_ms
        return self

    def __repr__(self) -> str:
        return f"Refusal({self.reason!r}, {self.hint_ms})"


def hint_of(wait_s: float) -> int:
    """An exact wait in seconds as a retry hint: whole milliseconds, rounded up (past float noise:
    0.18 s is 180 ms, not 181), at least 1."""
    return max(1, math.ceil(wait_s * 1000 - 1e-6))


class Grant:
    """What one admission charged: filled in by the limits' `charge`, read back by their
    `refund` and `release`. `endpoint` is where the pool routed it (None when no endpoint was up)."""

    __slots__ = ("endpoint",)

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None


class Limit(Protocol):
    def check(self, now: float) -> Refusal | None:
        """None when the request may go as far as this limit is concerned. Charges nothing: a
        refusal only books the refused client's retry appointment."""

    def charge(self, grant: Grant, now: float) -> None:
        """Take the request's cost; called only after every limit's `check` passed, at the same `now`."""

    def refund(self, grant: Grant) -> None:
        """Undo `charge` for a request that will not run (invalid once admitted)."""

    def release(self, grant: Grant, executed: bool) -> None:
        """The request ended (`executed`: with `done`): give back what it held while it ran."""


class Draining:
    """While the governor drains for shutdown, every new request yields."""

    __slots__ = ("draining", "_hints", "_refusal")

    def __init__(self, hints: RetryHintEstimator) -> None:
        self.draining = False
        self._hints = hints
        self._refusal = Refusal(YieldReason.DRAINING)

    def check(self, now: float) -> Refusal | None:
        return self._refusal.at(self._hints.hint_ms(now)) if self.draining else None

    def charge(self, grant: Grant, now: float) -> None:
        return None

    def refund(self, grant: Grant) -> None:
        return None

    def release(self, grant: Grant, executed: bool) -> None:
        return None


class InflightLimiter:
    """The hard cap on admitted, unfinished requests (`--max-inflight`): a non-blocking counting
    semaphore that never over-frees."""

    __slots__ = ("max_inflight", "inflight", "_hints", "_refusal")

    def __init__(self, max_inflight: int, hints: RetryHintEstimator) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.max_inflight = max_inflight
        self.inflight = 0
        self._hints = hints
        self._refusal = Refusal(YieldReason.INFLIGHT)

    def set_max(self, max_inflight: int) -> None:
        """Live change: a lower cap stops new admissions until in-flight falls under it."""
        self.max_inflight = max_inflight
        self._hints.set_capacity(max_inflight)

    def check(self, now: float) -> Refusal | None:
        if self.inflight < self.max_inflight:
            return None
        refusal = self._refusal  # `at` inlined: this check refuses every frame under overload
        refusal.hint_ms = self._hints.hint_ms(now)
        return refusal

    def charge(self, grant: Grant, now: float) -> None:
        self.inflight += 1

    def refund(self, grant: Grant) -> None:
        return None  # the slot is freed by `release`, as for any request that ends

    def release(self, grant: Grant, executed: bool) -> None:
        if self.inflight <= 0:
            # A double release would silently raise the effective cap; fail loudly instead.
            raise RuntimeError("release() without a matching charge")
        self.inflight -= 1


class RateLimit:
    """The cap on admissions per second over all endpoints (`--max-qps`, `--qps-burst`); a
    token bucket, so its hint is exact: the next token nobody was promised yet."""

    __slots__ = ("bucket", "_refusal")

    def __init__(self, qps: float, burst: float, now: float) -> None:
        self.bucket = make_bucket(qps, burst, now)
        self._refusal = Refusal(YieldReason.QPS)

    def set_rate(self, qps: float, burst: float, now: float) -> None:
        self.bucket = updated_bucket(self.bucket, qps, burst, now)

    def check(self, now: float) -> Refusal | None:
        bucket = self.bucket
        if bucket is not None and bucket.level(now) < 1.0:
            return self._refusal.at(hint_of(bucket.appointment_s(now)))
        return None

    def charge(self, grant: Grant, now: float) -> None:
        if self.bucket is not None:
            self.bucket.take()

    def refund(self, grant: Grant) -> None:
        if self.bucket is not None:
            self.bucket.refund()

    def release(self, grant: Grant, executed: bool) -> None:
        return None  # an admission per second is spent once admitted
