"""Deadline-aware admission: refuse at once a request that would not get its first token in time.

A frame may carry `deadline_ms`, the time to first token its client will wait. After the pool
has chosen the endpoint, this limit asks that endpoint's TTFT model (ttft.py) what this request
would see behind the requests already waiting there, and refuses with reason `deadline` when the
prediction exceeds the deadline; the hint is the excess, the time for the load ahead to drain
that much. Starting work that the client will have abandoned only delays everyone behind it
(Mooncake's early rejection on predicted TTFT). A request admitted anyway and still without a
first token at its deadline is cancelled by the lifecycle.

Before its prediction, a bound from the release forecast (release_forecast.py): an endpoint that
runs `batch` requests at once (its `batch=`, a worker's `--max-running` from its statistics, or
as learnt from its streams) starts a request
only when one of those ahead of it ends. When that forecast start is already past the deadline,
the frame is refused at once, even before the TTFT model has seen a first token (a cold model
cannot know that a queue of long requests is in the way; the forecast can). Its hint is the excess, as for a prediction.

The model learns only from the requests it lets in, so a prediction is never the reason to refuse
a frame when nothing runs at its endpoint: a model that predicts a miss even for an idle endpoint
(after a burst of slow first tokens raised its margin) would otherwise refuse every frame from
then on and never see one that proves it wrong. The frame goes in, as a probe, and the model
learns its first token (or its expiry).

It runs after the pool in `Admission`, reading the pool's choice; a frame without a deadline,
or an endpoint with no forecast bound and too few samples for its model, passes.
"""

from __future__ import annotations

from governor.admission.cost import Ask
from governor.admission.hints import RetryHintEstimator
from governor.admission.limits import Grant, Refusal, hint_of
from governor.admission.pool import Pool
from governor.admission.release_forecast import ReleaseForecast
from govwire.vocab import YieldReason


class DeadlineLimit:
    __slots__ = ("_pool", "_forecast", "_hints", "_predicted", "_refusal")

    def __init__(self, pool: Pool, forecast: ReleaseForecast, hints: RetryHintEstimator) -> None:
        self._pool = pool
        self._forecast = forecast
        self._hints = hints
        self._predicted: float | None = None  # from `check`, for the `charge` that follows
        self._refusal = Refusal(YieldReason.DEADLINE)

    def check(self, now: float, ask: Ask) -> Refusal | None:
        self._predicted = None
        deadline = ask.deadline_s
        endpoint = self._pool.choice
        if deadline is None or endpoint is None:
            return None
        batch = self._forecast.model(endpoint).batch
        ahead = endpoint.inflight + 1 - batch  # must end before it starts there
        if batch and ahead > 0:
            start = self._forecast.group_free_at(now, endpoint, ahead, self._hints.service_time_s)
            if start is not None and start - now > deadline:
                return self._refusal.at(hint_of(start - now - deadline))
        predicted = endpoint.ttft.predict(ask.prompt_tokens, endpoint.waiting_tokens, endpoint.waiting)
        if predicted is None:
            return None
        if predicted > deadline and endpoint.inflight:
            return self._refusal.at(hint_of(predicted - deadline))
        self._predicted = predicted
        return None

    def charge(self, grant: Grant, now: float) -> None:
        grant.predicted_ttft_s, self._predicted = self._predicted, None

    def refund(self, grant: Grant) -> None:
        return None

    def release(self, grant: Grant, executed: bool) -> None:
        return None
