"""When a client retries: the hint, a deadline, jitter, and a budget (sans-IO).

A yield is the governor saying "not now"; a client that retries every yield at once turns an
overload into a retry storm. So retries follow `retry_hint_ms` (exactly, when the yield booked
an appointment and carries its `retry_ticket`; else with a jitter that only ever adds), stop at
`max_attempts` or the deadline, and are capped by a budget shared by all requests of one client:
retries may add at most `budget_ratio` of the first attempts (plus a small reserve), the rule of
gRPC's retry throttling and the SRE book's per-client retry budget.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from govwire.errors import GovernorError, WorkerUnavailable


class Yielded(Exception):
    """The governor refused the request for now. `retry_hint_ms` says when a retry is likely to be
    admitted and `reason` which limit fired; with a `retry_ticket` the governor keeps the capacity
    for a retry that sends it back at that time (protocol.md). A `final` yield says nothing frees
    for it within the governor's promise horizon: it is not retried."""

    def __init__(
        self, request_id: str, retry_hint_ms: int, reason: str, retry_ticket: str | None = None, final: bool = False
    ) -> None:
        what = "final, do not retry" if final else f"retry in {retry_hint_ms} ms"
        super().__init__(f"yielded ({reason}); {what}")
        self.request_id = request_id
        self.retry_hint_ms = retry_hint_ms
        self.reason = reason
        self.retry_ticket = retry_ticket
        self.final = final


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 5  # first attempt included; 1 = never retry
    deadline_s: float = 30.0  # no retry starts later than this after the first attempt
    # Each wait without a ticket is the hint times a uniform factor in [1, 1 + jitter]: never
    # sooner than told. With a ticket the wait is the hint: the capacity is kept for it then.
    jitter: float = 0.2
    budget_ratio: float = 0.2  # retries may add at most this fraction of first attempts...
    budget_reserve: float = 10.0  # ...plus this many (so a quiet client can still retry)
    unavailable_backoff_ms: float = 250.0  # `worker_unavailable` has no hint: first wait, doubling

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.deadline_s < 0 or not 0 <= self.jitter < 1:
            raise ValueError("RetryPolicy: max_attempts >= 1, deadline_s >= 0, 0 <= jitter < 1")
        if self.budget_ratio < 0 or self.budget_reserve < 0 or self.unavailable_backoff_ms <= 0:
            raise ValueError("RetryPolicy: budget_ratio, budget_reserve >= 0; unavailable_backoff_ms > 0")


NO_RETRY = RetryPolicy(max_attempts=1)


class RetryBudget:
    """Tokens for retries, shared by one client's requests: a first attempt deposits
    `ratio`, a retry spends 1, and the balance never exceeds `reserve` + what deposits earned
    since. So over any run, retries <= reserve + ratio * first attempts."""

    __slots__ = ("_ratio", "_cap", "balance")

    def __init__(self, ratio: float, reserve: float) -> None:
        self._ratio = ratio
        self._cap = max(reserve, 1.0)
        self.balance = reserve

    def deposit(self) -> None:
        self.balance = min(self._cap, self.balance + self._ratio)

    def withdraw(self) -> bool:
        if self.balance < 1.0:
            return False
        self.balance -= 1.0
        return True


class Attempts:
    """One request's retry decisions: `wait_s(failure)` is how long to sleep before the next
    attempt, or None when the failure is final and should be raised."""

    __slots__ = ("_policy", "_budget", "_clock", "_rng", "_started", "_made", "_backoff_ms")

    def __init__(
        self, policy: RetryPolicy, budget: RetryBudget, clock: Callable[[], float], rng: random.Random
    ) -> None:
        self._policy = policy
        self._budget = budget
        self._clock = clock
        self._rng = rng
        self._started = clock()
        self._made = 1
        self._backoff_ms = policy.unavailable_backoff_ms
        budget.deposit()

    def wait_s(self, failure: Yielded | GovernorError) -> float | None:
        policy = self._policy
        jitter = policy.jitter
        if isinstance(failure, Yielded):
            if failure.final:
                return None  # refused for good: nothing frees for it soon
            base_ms = float(failure.retry_hint_ms)
            if failure.retry_ticket is not None:
                jitter = 0.0  # an appointment: come at its time, not later
        elif isinstance(failure, WorkerUnavailable):
            base_ms, self._backoff_ms = self._backoff_ms, self._backoff_ms * 2
        else:
            return None  # the request itself is at fault, or it may have run: not ours to repeat
        wait_s = base_ms / 1000 * self._rng.uniform(1, 1 + jitter)
        if self._made >= policy.max_attempts or self._clock() + wait_s - self._started > policy.deadline_s:
            return None
        if not self._budget.withdraw():
            return None
        self._made += 1
        return wait_s


class Retries:
    """One client's retry rule: its policy, the budget its requests share, its jitter source.
    Without a policy every failure is final."""

    __slots__ = ("_policy", "_budget", "_rng")

    def __init__(self, policy: RetryPolicy | None) -> None:
        self._policy = policy or NO_RETRY
        self._budget = RetryBudget(self._policy.budget_ratio, self._policy.budget_reserve)
        self._rng = random.Random()

    def start(self) -> Attempts:
        """The decisions for one new request."""
        return Attempts(self._policy, self._budget, time.monotonic, self._rng)
