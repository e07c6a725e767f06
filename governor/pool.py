"""The endpoint pool: per-endpoint soft caps under the global hard ones, and the routing.

A `Limit` (limits.py) that also chooses: `check` finds the least loaded endpoint that is up and
under its concurrency cap and its token bucket (relative to capacity, round-robin among equals),
`charge` takes that endpoint's slot and token. Refusals name the endpoint limit that was hit:
`endpoint_qps` with the exact wait of the bucket that refills first when only buckets stand in
the way, else `endpoint_inflight` with the service-time estimate. With no endpoint up at all it
does not refuse: the request is admitted without an endpoint and fails with
`worker_unavailable` (a yield would promise a retry that cannot succeed before a worker is back).
"""

from __future__ import annotations

import math

from governor.buckets import TokenBucket
from governor.endpoint import Endpoint
from governor.hints import RetryHintEstimator
from governor.limits import Grant, Refusal, hint_of
from govwire.vocab import YieldReason


class Pool:
    def __init__(self, endpoints: list[Endpoint], default_capacity: int, hints: RetryHintEstimator) -> None:
        self.endpoints = endpoints
        self.default_capacity = default_capacity  # what "relative to capacity" uses for uncapped endpoints
        self._hints = hints
        self._next = 0  # round-robin start among equally loaded endpoints
        self._choice: tuple[Endpoint, int] | None = None  # from `check`, for the `charge` that follows
        self._qps_refusal = Refusal(YieldReason.ENDPOINT_QPS)
        self._inflight_refusal = Refusal(YieldReason.ENDPOINT_INFLIGHT)

    def check(self, now: float) -> Refusal | None:
        self._choice = None
        endpoints = self.endpoints
        best: Endpoint | None = None
        best_index = 0
        best_load = math.inf
        qps_bucket: TokenBucket | None = None  # the endpoint bucket that refills first
        any_up = False
        n = len(endpoints)
        for k in range(n):
            index = (self._next + k) % n
            e = endpoints[index]
            if not e.up:
                continue
            any_up = True
            cap = e.limits.concurrency
            if cap and e.inflight >= cap:
                continue
            if e.bucket is not None and e.bucket.level(now) < 1.0:
                if qps_bucket is None or e.bucket.wait_s(now) < qps_bucket.wait_s(now):
                    qps_bucket = e.bucket
                continue
            load = e.inflight / ((cap or self.default_capacity) * e.limits.weight)
            if load < best_load:
                best, best_index, best_load = e, index, load
        if best is not None:
            self._choice = (best, best_index)
            return None
        if not any_up:
            return None  # admitted without an endpoint: dispatch answers worker_unavailable
        if qps_bucket is not None:
            return self._qps_refusal.at(hint_of(qps_bucket.appointment_s(now)))
        return self._inflight_refusal.at(self._hints.hint_ms(now))

    def charge(self, grant: Grant, now: float) -> None:
        choice, self._choice = self._choice, None
        if choice is None:
            return
        endpoint, index = choice
        if endpoint.bucket is not None:
            endpoint.bucket.take()
        endpoint.inflight += 1
        self._next = (index + 1) % len(self.endpoints)
        grant.endpoint = endpoint

    def refund(self, grant: Grant) -> None:
        endpoint = grant.endpoint
        if endpoint is not None and endpoint.bucket is not None:
            endpoint.bucket.refund()

    def release(self, grant: Grant, executed: bool) -> None:
        endpoint = grant.endpoint
        if endpoint is None:
            return
        if endpoint.inflight <= 0:
            raise RuntimeError("release() without a matching charge")
        endpoint.inflight -= 1
        if executed:
            endpoint.executed += 1
        else:
            endpoint.failed += 1
