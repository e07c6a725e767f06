"""When will the requests in flight end? The release forecast every retry hint is read from.

A refused client is told when the slot (or the tokens) it needs will be free. The governor sees
what decides that: each running request's `max_new_tokens`, the tokens it has streamed and when
its first one came. So each request's end is forecast from its own progress rather than from an
average service time spread evenly over the cap (which is wrong after a burst, when requests
admitted together end together, and wrong for a long stream that holds its slot for seconds):

    release = now + (time to its first token, if it has none yet) + (tokens left) x (its step time)
              + (its endpoint's gap from a last token to the final reply)

- **Tokens left**: `max_new_tokens` (all of it for a request that runs to its length:
  `stop_on_eos: false`, `ignore_eos`), else `max_new_tokens` x the share of it that requests
  really generate, less what it has streamed; at least one. The share is learnt from the
  requests that could end at an end of sequence and did end (early end-of-sequence makes
  `max_new_tokens` an upper bound). Two shares are kept while fewer than `CONFIDENT_AFTER` of
  them ended. The forecast, which every hint and appointment time is read from, takes the
  optimistic one (`OPTIMISTIC_SHARE`, or what ended if less): a hint too early costs its client
  a hold in the lobby, one too late idles the server while the client sleeps. Whether a promise
  fits the horizon is judged on the conservative one (all of `max_new_tokens` before any ended,
  then the learnt average), by stretching the wait by their ratio (`stretch`): a promise made on
  a length too short is one the horizon may not keep.
- **Step time**: a request that has streamed a few tokens is timed by its own pace, from its first
  to its latest token (which already carries the batch it runs in and its endpoint's speed);
  before that, by its endpoint's `EngineModel`: the gaps of the requests that ended there, and
  the pace of those streaming there now (read at every recompute, so the estimate moves with the
  first tokens of a cold burst, not only with its ends); before either, a prior (the endpoint's
  `step_ms=`, else the step time its worker reports, else what its probe measured,
  links/endpoint_probe.py, else `PRIOR_STEP_S`). While it rests on fewer than `CONFIDENT_AFTER`
  ended streams, the estimate is the fastest of what it has seen (the optimistic side): a hint
  too early costs its client a short hold in the lobby (appointments/lobby.py), a hint too late
  leaves the server idle while the client sleeps. So a cold burst is told real times, bounded by
  each request's own length, from the first moment. Its remaining tokens are counted from its
  latest one.
- **Time to its first token**: its endpoint's recent admission-to-first-token time (before any,
  its probe's, else a step), less what it has waited, at least one step.
- **A server that runs N at a time** and queues the rest (an OpenAI-compatible server with N
  slots, a serial one with one, a worker at its `--max-running`): when its endpoint has more
  admitted than N (its `batch=N`, else what its worker reports, else the most its probe or its
  streams showed running together while another admitted well before waited for its first token), it is N
  running plus a FIFO: the requests without a first token beyond the
  N wait in the order admitted, each starting when the earliest running one ends, its first token
  a step later. Without it, a queued request's end would be read from the endpoint's average time
  to a first token, and the k-th release of a queue would come too early.

The k-th release from now is the k-th smallest forecast. Past the last request in flight, the
releases repeat one service time later each round: the requests admitted into the freed slots end
about a service time after they start. The same list, weighted by each request's token cost,
answers the token budgets. The list is recomputed only when it is read and something changed
(an admission, a first token, an end) or it is older than `STALE_S`: under a refusal storm it is
read for every refused frame and computed a few hundred times a second.

Sans-IO: the clock is passed in. Each request's forecast is remembered the first time one is made
for it, and compared with its real end: `error` (forecast - actual, seconds) is exported as
`governor_release_forecast_error_seconds`, `relative_errors` (|error| / its service time) is what
the benchmark's accuracy figure is the median of.
"""

from __future__ import annotations

import heapq
import math
import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate

from governor.admission.cost import Ask
from governor.admission.endpoint import Endpoint
from governor.admission.limits import Grant, Progress
from governor.latency import Histogram

STALE_S = 0.02
"""A forecast list older than this is recomputed even if nothing was admitted or ended: the
requests in it have streamed tokens since."""

PRIOR_STEP_S = 0.1
"""The time between two tokens assumed of an endpoint before any of its streams was seen (unless
its `step_ms=` says): on the slow side of a CPU-served small model, because a forecast that is
late refuses a cold burst at once where one that is early books appointments its returns find
still taken. Replaced by the first request's own pace after two tokens."""

SMOOTHING = 0.2
"""EWMA weight of the newest sample of a step time, a time to first token, or a length ratio."""

CONFIDENT_AFTER = 8
"""Ended streams of an endpoint after which its step estimate is its learnt average; before, the
fastest of what it has (learnt, streaming now, probed or told): the optimistic side. The same
for the share of `max_new_tokens` generated, over the requests that could end early."""

OPTIMISTIC_SHARE = 0.25
"""The share of `max_new_tokens` a request that may end early is forecast to generate while fewer
than `CONFIDENT_AFTER` such requests ended (less if those that ended generated less): the
optimistic side of a length nobody has seen yet (clients ask for far more than they get: the
tiny GPT-2 of the benchmarks ends at 0.3 to 0.55 of 32, a chat answer at a few hundred of
thousands). A cold burst's clients are told times that come before their capacity rather than
after it, and are held in the lobby for the difference."""

OWN_RATE_AFTER = 4
"""A request that has streamed this many tokens is timed by its own inter-token gap."""

QUEUED_AFTER_STEPS = 3
"""A request admitted before another's first token and still without its own this many steps later
(at that other's last token) waits in its server's queue: a server that batches takes a step or
two to start a new request."""

MIN_REMAINING_S = 0.001
"""The least a request still running past its forecast end is forecast to hold its slot more."""

FORECAST_ERROR_BUCKETS = (
    -5.0,
    -2.0,
    -1.0,
    -0.5,
    -0.2,
    -0.1,
    -0.05,
    -0.02,
    0.0,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
"""Seconds, forecast minus actual release: negative = the request ended later than forecast."""


class EngineModel:
    """One endpoint's speed as its streams show it: the time between two tokens of a request (a
    decode step at the batch it ran in) and the time from admission to a first token."""

    __slots__ = ("step_s", "first_token_s", "endpoint", "end_gap_s", "batch_seen", "streams", "estimate_s")

    def __init__(self, endpoint: Endpoint | None = None) -> None:
        self.step_s: float | None = None  # learnt: None before a stream ended here
        self.streams = 0  # the ended streams `step_s` was learnt from
        # The step a request not yet streaming is forecast with (`estimate`, at each recompute).
        self.estimate_s = PRIOR_STEP_S
        self.first_token_s: float | None = None
        self.endpoint = endpoint
        # The most requests seen streaming at once here while another waited for its first token
        # (`ReleaseForecast.ended`): how many the server runs, the rest queued in it. 0: no queue seen.
        self.batch_seen = 0
        # From a request's last token to its end (the final reply that releases it): a server may
        # send its finish a step later, or after the usage it counts.
        self.end_gap_s = 0.0

    @property
    def prior_step_s(self) -> float | None:
        """What a step is taken to be before any stream here: the endpoint's `step_ms=`, else what
        its worker reports (EngineStats.step_seconds), else what its probe measured; None: nothing
        known (the forecast then assumes `PRIOR_STEP_S`)."""
        endpoint = self.endpoint
        if endpoint is None:
            return None
        if endpoint.limits.step_ms:
            return endpoint.limits.step_ms / 1000.0
        if endpoint.reported_step_s is not None:
            return endpoint.reported_step_s
        probed = endpoint.probed
        return None if probed is None else probed.step_s

    def estimate(self, streaming_s: float | None) -> float:
        """The step a request not yet streaming is forecast with, given the median pace of the
        requests streaming here now (`streaming_s`, None if none shows one): once `CONFIDENT_AFTER`
        streams ended here, their average; before, the fastest of that average, the pace now and
        the prior; with none of them, `PRIOR_STEP_S`."""
        learnt = self.step_s
        if learnt is not None and self.streams >= CONFIDENT_AFTER:
            self.estimate_s = learnt
            return learnt
        known = [x for x in (learnt, streaming_s, self.prior_step_s) if x is not None and x > 0]
        self.estimate_s = min(known) if known else PRIOR_STEP_S
        return self.estimate_s

    @property
    def to_first_token_s(self) -> float:
        """From admission to a first token, as seen here (else as probed, else a step)."""
        if self.first_token_s is not None:
            return self.first_token_s
        endpoint = self.endpoint
        probed = None if endpoint is None else endpoint.probed
        if probed is not None and probed.first_token_s is not None:
            return probed.first_token_s
        return self.estimate_s

    @property
    def batch(self) -> int:
        """How many requests the endpoint's server runs at once, the rest queued in it: its
        `batch=`, else what its worker reports (`--max-running`, Endpoint.batch), else as learnt
        from its streams; 0: no bound known, every request admitted runs."""
        endpoint = self.endpoint
        if endpoint is None:
            return 0
        probed = 0 if endpoint.probed is None else endpoint.probed.batch
        return endpoint.limits.batch or endpoint.batch or max(probed, self.batch_seen)

    def observe_first_token(self, seconds: float) -> None:
        self.first_token_s = _ewma(self.first_token_s, seconds)

    def observe_stream(self, first_token_at: float, last_token_at: float, ended_at: float, tokens: int) -> None:
        """A request streamed `tokens` tokens, the first at `first_token_at` and the last at
        `last_token_at`, and ended at `ended_at`: the steps are timed to its last token, the gap
        from there to its final reply apart (it is no step: it comes once per request)."""
        if tokens >= 2 and last_token_at > first_token_at:
            self.step_s = _ewma(self.step_s, (last_token_at - first_token_at) / (tokens - 1))
            self.streams += 1
        gap = ended_at - last_token_at
        self.end_gap_s += SMOOTHING * ((gap if gap > 0 else 0.0) - self.end_gap_s)


Promised = tuple[list[float], float]
"""The appointments of a book (their times, ascending) and how long after its appointment each
holder's slot is free again: when the capacity promised comes back."""

NOTHING_PROMISED: Promised = ([], 0.0)


def _kth(a: Callable[[int], float], na: int, b: list[float], after: float, k: int) -> float:
    """The k-th smallest (from 0) of two ascending sequences together (`b` shifted by `after`),
    by bisection on how many come from `a`: O(log) reads, however long the book `b` is."""
    nb = len(b)
    take = k + 1
    lo, hi = max(0, take - nb), min(take, na)
    while True:
        x = (lo + hi) // 2
        y = take - x
        a_left = a(x - 1) if x > 0 else -math.inf
        a_right = a(x) if x < na else math.inf
        b_left = b[y - 1] + after if y > 0 else -math.inf
        b_right = b[y] + after if y < nb else math.inf
        if a_left > b_right:
            hi = x - 1
        elif b_left > a_right:
            lo = x + 1
        else:
            return a_left if a_left > b_left else b_left


def _admitted_at(grant: Grant) -> float:
    return grant.t_admitted


def stream_pace(progress: Progress) -> float | None:
    """A stream's time between two tokens, from its first to its latest; None before two tokens
    came apart (tokens read at once tell no pace). A request's, and a probe's
    (links/endpoint_probe.py)."""
    first = progress.t_first_token
    seen = progress.tokens_seen
    if first is None or seen < 2 or progress.t_last_token <= first:
        return None
    return (progress.t_last_token - first) / (seen - 1)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + SMOOTHING * (sample - old)


class ReleaseForecast:
    """The forecast ends of the requests in flight. Charged like a limit (it never refuses): every
    admitted request is followed from its admission to its release."""

    __slots__ = (
        "length_ratio",
        "_lengths",
        "_length_sum",
        "_share",
        "_stretch",
        "_spans",
        "models",
        "error",
        "relative_errors",
        "_live",
        "_dirty",
        "_computed_at",
        "_times",
        "_cumulative",
        "_round_s",
        "_groups",
        "cost_groups",
        "_group_costs",
        "_group_tokens",
    )

    def __init__(self) -> None:
        # Generated tokens / max_new_tokens, over the requests that ended that could end early
        # (`Ask.to_length` false: one that runs to its length says nothing of the others).
        self.length_ratio = 1.0  # the conservative share: 1 before any ended
        self._lengths = 0  # how many it was learnt from
        self._length_sum = 0.0  # their sum (their mean is the optimistic share's bound)
        self._share = OPTIMISTIC_SHARE  # the share forecasts take (`_learn_length`)
        # The time left of the requests in flight, summed as forecast (optimistic lengths) and
        # as the conservative share would have it: `stretch` is their ratio (at each compute).
        self._spans = [0.0, 0.0]
        self._stretch = 1.0
        self.models: dict[Endpoint | None, EngineModel] = {}
        self.error = Histogram(FORECAST_ERROR_BUCKETS)
        self.relative_errors: deque[float] = deque(maxlen=2048)
        self._live: dict[int, Grant] = {}
        self._dirty = True
        self._computed_at = -math.inf
        self._times: list[float] = []  # forecast releases, ascending
        self._cumulative: list[int] = []  # running sums of the token cost each of them frees
        self._round_s = 0.0  # how much later the next round of releases comes (a service time)
        self._groups: dict[object, list[float]] = {}  # forecast releases by endpoint and by tenant
        # The same, with each one's cost: kept only once a tenant's or an endpoint's own token cap
        # books appointments (`cost_groups`, set by admission), which `tokens_free_at(among=)` reads.
        self.cost_groups = False
        self._group_costs: dict[object, list[tuple[float, int]]] = {}
        self._group_tokens: dict[object, tuple[list[float], list[int]]] = {}  # made from those when read

    def __len__(self) -> int:
        return len(self._live)

    def model(self, endpoint: Endpoint | None) -> EngineModel:
        model = self.models.get(endpoint)
        if model is None:
            model = self.models[endpoint] = EngineModel(endpoint)
        return model

    # -- a Limit that never refuses: it follows each admitted request ------------------------------

    def check(self, now: float, ask: object) -> None:
        return None

    def charge(self, grant: Grant, now: float) -> None:
        grant.t_admitted = now
        if grant.endpoint not in self.models:  # (charged after the pool chose it) its batch= is read from its model
            self.model(grant.endpoint)
        self._live[id(grant)] = grant
        self._dirty = True

    def refund(self, grant: Grant) -> None:
        return None  # it leaves with `release`, as every request does

    def release(self, grant: Grant, executed: bool) -> None:
        if self._live.pop(id(grant), None) is not None:
            self._dirty = True

    # -- learning ------------------------------------------------------------------------------------

    def started(self, grant: Grant, now: float) -> None:
        self.model(grant.endpoint).observe_first_token(now - grant.t_admitted)
        self._dirty = True

    def ended(self, grant: Grant, executed: bool, now: float) -> None:
        """A request ended at `now` (after `release`): its stream teaches its endpoint's step time,
        its length the ratio, and its first forecast is scored."""
        progress = grant.progress
        if progress is None:
            return
        first = progress.t_first_token
        tokens = progress.tokens_seen
        if executed and first is not None:
            model = self.model(grant.endpoint)
            model.observe_stream(first, progress.t_last_token, now, tokens)
            self._learn_batch(model, grant, first, progress.t_last_token)
            asked = grant.ask.max_new_tokens
            if asked > 0 and not grant.ask.to_length:
                self._learn_length(min(1.0, tokens / asked))
        forecast = grant.forecast_s
        if forecast is not None and executed:
            error = forecast - now
            self.error.observe(error)
            service = now - grant.t_admitted
            if service > 0:
                self.relative_errors.append(abs(error) / service)

    def _learn_length(self, share: float) -> None:
        """A request that could end early generated `share` of its `max_new_tokens`: the
        conservative share moves towards it from 1; the optimistic one, while fewer than
        `CONFIDENT_AFTER` ended, is the least of it, their mean and `OPTIMISTIC_SHARE`. At
        `CONFIDENT_AFTER` both become their mean (the average moves on from there), not what is
        left of the 1 the conservative one started from."""
        self._lengths += 1
        self._length_sum += share
        if self._lengths == CONFIDENT_AFTER:
            self.length_ratio = self._length_sum / self._lengths
        else:
            self.length_ratio = _ewma(self.length_ratio, share)
        if self._lengths >= CONFIDENT_AFTER:
            self._share = self.length_ratio
        else:
            self._share = min(self.length_ratio, self._length_sum / self._lengths, OPTIMISTIC_SHARE)

    def stretch(self) -> float:
        """How much longer than forecast the requests in flight may run, by what ended so far: the
        time they have left at the conservative share over the time the forecast gives them (at
        the optimistic share), summed over them as of the last compute. 1 once `CONFIDENT_AFTER`
        ended, or while every request in flight runs to its length. A wait read from the
        forecast, stretched by it, is what a promise is judged on (appointments/books.py)."""
        return self._stretch

    def _learn_batch(self, model: EngineModel, grant: Grant, first: float, last: float) -> None:
        """A request streamed from `first` to `last`. Was a request admitted to its
        endpoint before its first token still waiting for its own at its last, at least
        `QUEUED_AFTER_STEPS` steps later (a server that batches starts a new request within a
        step or two), while only so many streamed beside it, the server runs that many at once
        and queues the rest: it is learnt (the most seen). Only once a step is known, and not for
        an endpoint whose batch is given (`batch=`, or its worker's report). The others counted
        overlap its stream: their first token before its last, their latest after its first (a
        serial server's next request starts only after its last token)."""
        endpoint = grant.endpoint
        step = model.step_s
        if (
            endpoint is None
            or step is None
            or endpoint.limits.batch
            or endpoint.batch
            or last - first < QUEUED_AFTER_STEPS * step
        ):
            return
        streaming, queued = 1, False
        for other in self._live.values():
            if other is grant or other.endpoint is not endpoint:
                continue
            progress = other.progress
            other_first = None if progress is None else progress.t_first_token
            if other_first is None:
                queued = queued or other.t_admitted < first
            elif other_first < last and progress is not None and progress.t_last_token > first:
                streaming += 1
        if queued and streaming > model.batch_seen:
            model.batch_seen = streaming

    # -- the forecast --------------------------------------------------------------------------------

    def _release_at(self, grant: Grant, now: float, starts_at: float | None = None) -> float:
        """When this request will give back what it was charged: its tokens left at its own pace,
        else its endpoint's estimate (`EngineModel.estimate`). `starts_at`: it waits in its server's
        queue until then (the FIFO of an endpoint running a bounded batch), and its first token
        comes a step after."""
        model = self.model(grant.endpoint)
        learnt = model.step_s
        step = model.estimate_s
        progress = grant.progress
        seen = 0 if progress is None else progress.tokens_seen
        first = None if progress is None else progress.t_first_token
        ask = grant.ask
        asked = float(ask.max_new_tokens)
        left = (asked if ask.to_length else asked * self._share) - seen
        if left < 1.0:
            left = 1.0
        longer = 0.0  # how many more its tokens left are at the conservative share
        if not ask.to_length:
            longer = asked * self.length_ratio - seen - left
            if longer < 0.0:
                longer = 0.0
        if progress is not None and (seen >= OWN_RATE_AFTER or learnt is None):
            own = stream_pace(progress)
            if own is not None:
                step = own
        if progress is not None and first is not None:
            at = progress.t_last_token + left * step
        elif starts_at is not None:
            at = starts_at + left * step
        else:
            at = grant.t_admitted + model.to_first_token_s
            if at < now:  # later than usual: its first token is at least a step away
                at = now + step
            at += (left - 1.0) * step
        at += model.end_gap_s  # its last token is not its end
        if at <= now:  # overdue: no sooner than its next token
            at = now + (step if step > MIN_REMAINING_S else MIN_REMAINING_S)
        # Its own time left (a queued one's from its start: the wait is others' time, counted there).
        spans = self._spans
        spans[0] += at - (starts_at if starts_at is not None and starts_at > now else now)
        spans[1] += longer * step
        return at

    def _queue_releases(self, grants: list[Grant], batch: int, now: float) -> list[tuple[float, Grant]]:
        """The releases of one endpoint's requests when it runs `batch` at once and queues the
        rest (fewer than it has admitted): those with a first token and the earliest admitted of
        the others run, ending as `_release_at` says; each of the rest, in the order admitted,
        starts when the earliest running one ends."""
        waiting = sorted(
            (g for g in grants if g.progress is None or g.progress.t_first_token is None), key=_admitted_at
        )
        running = [g for g in grants if g.progress is not None and g.progress.t_first_token is not None]
        room = batch - len(running)
        if room > 0:
            running += waiting[:room]
            waiting = waiting[room:]
        out = [(self._release_at(g, now), g) for g in running]
        ends = [at for at, _ in out]
        heapq.heapify(ends)
        for grant in waiting:
            at = self._release_at(grant, now, heapq.heappop(ends))
            heapq.heappush(ends, at)
            out.append((at, grant))
        return out

    def _estimate_steps(self) -> None:
        """Each endpoint's step for its requests not yet streaming (`EngineModel.estimate`), from
        what ended there and the median pace of its requests streaming now: a cold endpoint's
        estimate follows its first tokens, not only its first ends."""
        paces: dict[Endpoint | None, list[float]] = {}
        for grant in self._live.values():
            progress = grant.progress
            pace = None if progress is None else stream_pace(progress)
            if pace is not None:
                paces.setdefault(grant.endpoint, []).append(pace)
        for endpoint, model in self.models.items():
            seen = paces.get(endpoint)
            model.estimate(statistics.median(seen) if seen else None)

    def _compute(self, now: float, service_s: float | None) -> None:
        self._estimate_steps()
        spans = self._spans
        spans[0] = spans[1] = 0.0
        pairs = []
        groups: dict[object, list[float]] = {}
        costs: dict[object, list[tuple[float, int]]] = {}
        cost_groups = self.cost_groups
        for at, grant in self._releases(now):
            if grant.forecast_s is None:
                grant.forecast_s = at
            pair = (at, grant.ask.cost)
            pairs.append(pair)
            for key in (grant.endpoint, grant.ask.tenant):
                if key is not None:
                    groups.setdefault(key, []).append(at)
                    if cost_groups:
                        costs.setdefault(key, []).append(pair)
        pairs.sort()
        for times in groups.values():
            times.sort()
        self._groups = groups
        self._group_costs = costs
        self._group_tokens = {}
        self._times = [at for at, _ in pairs]
        self._cumulative = list(accumulate(cost for _, cost in pairs))
        # A request admitted into a freed slot ends about a service time later: the observed one,
        # else the longest forecast (the round the requests in flight now take at most).
        if service_s:
            self._round_s = service_s
        else:
            self._round_s = self._times[-1] - now if self._times else 0.0
        self._stretch = 1.0 + spans[1] / spans[0] if spans[1] > 0.0 else 1.0
        self._computed_at = now
        self._dirty = False

    def _releases(self, now: float) -> list[tuple[float, Grant]]:
        """Each request's forecast release; an endpoint that runs a bounded batch and has more
        admitted than that is a FIFO (`_queue_releases`)."""
        live = self._live.values()
        batches = {e: m.batch for e, m in self.models.items() if e is not None and m.batch}
        if not batches:
            return [(self._release_at(grant, now), grant) for grant in live]
        out = []
        queues: dict[Endpoint, list[Grant]] = {}
        for grant in live:
            endpoint = grant.endpoint
            if endpoint is not None and endpoint in batches:
                queues.setdefault(endpoint, []).append(grant)
            else:
                out.append((self._release_at(grant, now), grant))
        for endpoint, grants in queues.items():
            if len(grants) > batches[endpoint]:
                out += self._queue_releases(grants, batches[endpoint], now)
            else:
                out += [(self._release_at(grant, now), grant) for grant in grants]
        return out

    def _refresh(self, now: float, service_s: float | None) -> None:
        if self._dirty or now - self._computed_at > STALE_S:
            self._compute(now, service_s)

    def slot_free_at(
        self,
        now: float,
        k: int,
        service_s: float | None,
        free: int = 0,
        promised: Promised = NOTHING_PROMISED,
        among: Sequence[object] | None = None,
    ) -> float | None:
        """When the k-th slot (k >= 1) not yet taken comes free; None when nothing is in flight. Slots come free from
        three places: `free` are free now (and promised: whoever takes them is not counted in `k`), each request in
        flight releases its own, and each promised appointment's slot is free again one service time after its holder
        took it (`promised`). Past all of them, the same again a service time later per round. `among`: only the
        requests of these endpoints count (an endpoint cap's book), else all of them."""
        if self._dirty or now - self._computed_at > STALE_S:  # `_refresh`, inlined: every refusal reads it
            self._compute(now, service_s)
        times = self._times if among is None else self._group_times(among)
        if self._round_s <= 0 or not (free or times):
            return None
        ats, after = promised
        n = free + len(times)
        # From 0, counting the free slots; past every slot known, a round (a service time) later.
        rounds, k = divmod(k - 1 + free, n + len(ats))
        later = rounds * self._round_s
        last = times[-1] if times else now
        if not ats or ats[0] + after >= last:  # the usual case: every promise ends after them
            if k < n:
                return (now if k < free else times[k - free]) + later
            return ats[k - n] + after + later
        return _kth(lambda j: now if j < free else times[j - free], n, ats, after, k) + later

    def tokens_free_at(
        self,
        now: float,
        amount: float,
        service_s: float | None,
        promised: Promised = NOTHING_PROMISED,
        promised_cumulative: Sequence[float] = (),
        round_delay_s: float = 0.0,
        among: object = None,
    ) -> float | None:
        """When `amount` token cost will have been given back; None when nothing is in flight (or
        it holds no cost). Cost comes back from the requests in flight at their forecast ends and
        from the requests promised appointments will start (`promised`, ascending, with the
        running sums of their costs): the earliest time the two together reach `amount`. Past all
        of them, each round of the requests in flight adds a service time and `round_delay_s`.
        `among`: only the requests of this endpoint or tenant count (its own token cap's book)."""
        self._refresh(now, service_s)
        times, cumulative = (self._times, self._cumulative) if among is None else self._tokens_of(among)
        if self._round_s <= 0 or not times or cumulative[-1] <= 0:
            return None
        booked = promised_cumulative[-1] if promised_cumulative else 0.0
        if amount > cumulative[-1] + booked:  # past all: the in-flight requests' next rounds
            rounds, rest = divmod(amount - booked, cumulative[-1])
            if rest == 0:
                rounds, rest = rounds - 1, cumulative[-1]
            return times[bisect_left(cumulative, rest)] + rounds * (self._round_s + round_delay_s)

        ats, after = promised

        def released(t: float) -> float:
            i = bisect_right(times, t)
            j = bisect_right(ats, t - after)
            return (cumulative[i - 1] if i else 0) + (promised_cumulative[j - 1] if j else 0.0)

        best = math.inf
        for sequence, shift in ((times, 0.0), (ats, after)):
            lo, hi = 0, len(sequence)  # the first time in it by which `amount` is back
            while lo < hi:
                mid = (lo + hi) // 2
                if released(sequence[mid] + shift) >= amount:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < len(sequence) and sequence[lo] + shift < best:
                best = sequence[lo] + shift
        return max(now, best)

    def _tokens_of(self, key: object) -> tuple[list[float], list[int]]:
        """The forecast releases of one endpoint's (or tenant's) requests, ascending, and the running
        sums of their token costs (made when first read after a compute)."""
        made = self._group_tokens.get(key)
        if made is None:
            pairs = sorted(self._group_costs.get(key, ()))
            made = self._group_tokens[key] = ([at for at, _ in pairs], list(accumulate(cost for _, cost in pairs)))
        return made

    def _group_times(self, keys: Sequence[object]) -> list[float]:
        """The forecast releases of the requests of these endpoints (or tenants), ascending."""
        groups = self._groups
        if len(keys) == 1:
            return groups.get(keys[0]) or []
        return sorted(at for key in keys for at in groups.get(key, ()))

    def group_free_at(self, now: float, key: object, k: int, service_s: float | None) -> float | None:
        """When the k-th release (k >= 1) among the requests of one endpoint or one tenant comes;
        past those in flight, a service time later per round. None when none is in flight."""
        self._refresh(now, service_s)
        times = self._groups.get(key)
        if not times or self._round_s <= 0:
            return None
        rounds, index = divmod(k - 1, len(times))
        return times[index] + rounds * self._round_s

    def service_of(self, ask: Ask) -> float | None:
        """How long the request of `ask` admitted now would hold its slot, on the slowest
        endpoint whose speed was learnt (where it runs is chosen after the caps are checked): its
        time to a first token and its tokens at the learnt step, and its end gap. Its tokens are
        all of `max_new_tokens` for a request that runs to its length, else the conservative share
        of them (`length_ratio`: a slot is lent only on a length that will not overrun). None
        until a stream has ended somewhere: a prior is a guess, and what reads this (a backfill,
        appointments/books.py) lends capacity only on what was seen."""
        longest: float | None = None
        for model in self.models.values():
            step = model.step_s
            if step is None:
                continue
            tokens = ask.max_new_tokens if ask.to_length else ask.max_new_tokens * self.length_ratio
            first = step if model.first_token_s is None else model.first_token_s
            service = first + (tokens - 1.0 if tokens > 1.0 else 0.0) * step + model.end_gap_s
            if longest is None or service > longest:
                longest = service
        return longest
