"""The release forecast: each request's end from its own progress, the k-th release, the token
cost released over time, and the forecast scored against the real end (simulated clock)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from governor.admission.cost import Ask
from governor.admission.endpoint import Endpoint, EndpointLimits, Probed
from governor.admission.limits import Grant
from governor.admission.release_forecast import (
    CONFIDENT_AFTER,
    OPTIMISTIC_SHARE,
    PRIOR_STEP_S,
    EngineModel,
    ReleaseForecast,
)


@dataclass
class Stream:
    tokens_seen: int = 0
    t_first_token: float | None = None
    t_last_token: float = 0.0

    def token(self, now: float) -> None:
        self.tokens_seen += 1
        self.t_last_token = now
        if self.t_first_token is None:
            self.t_first_token = now


ENDPOINT = Endpoint("e", EndpointLimits(), now=0.0)


def admitted(
    forecast: ReleaseForecast, now: float, max_new_tokens: int, cost: int = 0, endpoint: Endpoint = ENDPOINT
) -> tuple[Grant, Stream]:
    grant = Grant(Ask(max_new_tokens=max_new_tokens, cost=cost))
    grant.endpoint = endpoint
    stream = Stream()
    grant.progress = stream
    forecast.charge(grant, now)
    return grant, stream


def test_nothing_in_flight_forecasts_nothing() -> None:
    forecast = ReleaseForecast()
    assert forecast.slot_free_at(0.0, 1, None) is None
    assert forecast.slot_free_at(0.0, 1, 2.0) is None  # a service time known changes nothing
    assert forecast.tokens_free_at(0.0, 1, 2.0) is None
    assert forecast.group_free_at(0.0, ENDPOINT, 1, 2.0) is None


def test_a_cold_endpoint_forecasts_a_request_from_the_prior_step_and_its_own_length() -> None:
    """No stream seen: its first token a step after its admission, then one a step, each step the
    prior (PRIOR_STEP_S, or the endpoint's `step_ms=`); no service time is needed, nor read."""
    forecast = ReleaseForecast()
    admitted(forecast, 0.0, 10)
    assert forecast.slot_free_at(0.0, 1, None) == pytest.approx(0.0 + (1 + (10 - 1)) * PRIOR_STEP_S)
    forecast = ReleaseForecast()
    admitted(forecast, 0.0, 10)
    assert forecast.slot_free_at(0.0, 1, 5.0) == pytest.approx(10 * PRIOR_STEP_S)  # not the 5 s observed
    fast = Endpoint("fast", EndpointLimits(step_ms=20), now=0.0)
    forecast = ReleaseForecast()
    admitted(forecast, 0.0, 10, endpoint=fast)
    admitted(forecast, 0.0, 3)  # on ENDPOINT: the default prior
    assert forecast.slot_free_at(0.0, 1, None) == pytest.approx((1 + (10 - 1)) * 0.02)
    assert forecast.slot_free_at(0.0, 2, None) == pytest.approx((1 + (3 - 1)) * PRIOR_STEP_S)


def test_the_step_a_worker_reports_is_the_prior_unless_the_operator_set_one() -> None:
    """A worker says what a step takes it (EngineStats.step_seconds: the echo engine's token
    delay, the GPT-2 engine's mean step): before any stream ended there, that is the prior; an
    endpoint's `step_ms=` still wins; a learnt step replaces both."""
    reported = Endpoint("reported", EndpointLimits(), now=0.0)
    reported.reported_step_s = 0.02
    set_by_hand = Endpoint("by-hand", EndpointLimits(step_ms=50), now=0.0)
    set_by_hand.reported_step_s = 0.02
    forecast = ReleaseForecast()
    admitted(forecast, 0.0, 10, endpoint=reported)
    admitted(forecast, 0.0, 10, endpoint=set_by_hand)
    assert forecast.slot_free_at(0.0, 1, None) == pytest.approx(10 * 0.02)
    assert forecast.slot_free_at(0.0, 2, None) == pytest.approx(10 * 0.05)
    reported.reported_step_s = 0.03  # reported again (each stats push): read when forecasting
    later = ReleaseForecast()
    admitted(later, 0.0, 10, endpoint=reported)
    assert later.slot_free_at(0.0, 1, None) == pytest.approx(10 * 0.03)


def test_what_a_probe_measured_is_the_prior_after_the_operators_and_the_workers_word() -> None:
    """An OpenAI-compatible endpoint probed as it came up (links/endpoint_probe.py): its first
    token after the probe's, then one a probed step; its probed batch makes it a queue; the
    operator's `step_ms=` and `batch=` win, and so does a worker's report."""
    probed = Endpoint("probed", EndpointLimits(), now=0.0)
    probed.probed = Probed(step_s=0.01, first_token_s=0.05, batch=1)
    forecast = ReleaseForecast()
    admitted(forecast, 0.0, 10, endpoint=probed)
    admitted(
        forecast, 0.0, 10, endpoint=probed
    )  # waits in its queue: from the first one's end, a step to its first token
    assert forecast.slot_free_at(0.0, 1, None) == pytest.approx(0.05 + 9 * 0.01)
    assert forecast.slot_free_at(0.0, 2, None) == pytest.approx(0.05 + 9 * 0.01 + 10 * 0.01)
    told = Endpoint("told", EndpointLimits(step_ms=20, batch=2), now=0.0)
    told.probed = Probed(step_s=0.01, first_token_s=0.05, batch=1)
    forecast = ReleaseForecast()
    for _ in range(2):
        admitted(forecast, 0.0, 10, endpoint=told)
    assert forecast.slot_free_at(0.0, 2, None) == pytest.approx(0.05 + 9 * 0.02)  # both run: batch=2 told


def test_a_cold_endpoints_waiting_requests_follow_the_pace_of_its_first_streams_not_the_prior() -> None:
    """Nothing ended yet and nothing told: a request not yet streaming is forecast at the pace its
    endpoint's running streams show (their median), from the moment they show one, not at
    `PRIOR_STEP_S` until the first of them ends."""
    forecast = ReleaseForecast()
    _, running = admitted(forecast, 0.0, 10)
    waiting, _ = admitted(forecast, 0.0, 10)
    assert forecast.slot_free_at(0.0, 2, None) == pytest.approx(10 * PRIOR_STEP_S)  # before any token: the prior
    for at in (0.01, 0.015, 0.02):
        running.token(at)
    # its first token a step after it waited past its usual first-token time, then 9 more, 5 ms each
    assert forecast.slot_free_at(0.021, 2, None) == pytest.approx(0.021 + 10 * 0.005)
    assert waiting.progress is not None and waiting.progress.tokens_seen == 0


def test_while_few_streams_ended_the_estimate_is_the_fastest_seen_then_their_average() -> None:
    """Before `CONFIDENT_AFTER` streams ended, the step for a waiting request is the least of what
    ended, what streams now and what the probe measured (a hint a little early costs a hold in
    the lobby; one late idles the server); from then on, what ended."""
    endpoint = Endpoint("e", EndpointLimits(), now=0.0)
    endpoint.probed = Probed(step_s=0.01, first_token_s=None)
    forecast = ReleaseForecast()
    model = forecast.model(endpoint)
    model.step_s, model.streams = 0.02, 1
    assert model.estimate(None) == pytest.approx(0.01)
    assert model.estimate(0.005) == pytest.approx(0.005)
    model.streams = CONFIDENT_AFTER
    assert model.estimate(0.005) == pytest.approx(0.02)
    assert EngineModel().estimate(None) == PRIOR_STEP_S  # nothing known at all


def test_before_any_stream_the_kth_slot_counts_the_forecasts_the_free_and_the_promised() -> None:
    forecast = ReleaseForecast()
    # admitted at 1.0, no stream seen: 10 and 15 tokens at the prior 0.1 s end at 2.0 and 2.5
    admitted(forecast, 1.0, 10)
    admitted(forecast, 1.0, 15)
    assert forecast.slot_free_at(1.0, 1, 2.0) == pytest.approx(2.0)
    assert forecast.slot_free_at(1.0, 2, 2.0) == pytest.approx(2.5)
    # past those in flight, the next round: a service time (2 s) after the first
    assert forecast.slot_free_at(1.0, 3, 2.0) == pytest.approx(4.0)
    # the slot promised to an appointment at 2.0 is free again after its holder's service
    assert forecast.slot_free_at(1.0, 3, 2.0, promised=([2.0], 2.0)) == pytest.approx(4.0)
    assert forecast.slot_free_at(1.0, 2, 2.0, promised=([0.2], 2.0)) == pytest.approx(2.2)
    # a slot free now counts first (its holder is not among the k)
    assert forecast.slot_free_at(1.0, 1, 2.0, free=1, promised=([1.0], 2.0)) == pytest.approx(2.0)
    assert forecast.slot_free_at(1.0, 2, 2.0, free=1, promised=([1.0], 2.0)) == pytest.approx(2.5)


def test_a_long_stream_is_forecast_from_its_own_pace_not_an_average() -> None:
    """The openai SDK case: one request asked for 100 tokens and streams one every 20 ms."""
    forecast = ReleaseForecast()
    forecast.model(ENDPOINT).step_s = 0.001  # what short requests taught: far faster
    _, stream = admitted(forecast, 0.0, 100)
    for i in range(25):
        stream.token(0.1 + 0.02 * i)
    now = stream.t_last_token + 0.005
    # 75 tokens left at 20 ms each, from its latest token
    assert forecast.slot_free_at(now, 1, 0.05) == pytest.approx(stream.t_last_token + 75 * 0.02)


def test_a_request_without_a_first_token_waits_for_it_then_decodes() -> None:
    forecast = ReleaseForecast()
    model = forecast.model(ENDPOINT)
    model.step_s, model.first_token_s = 0.01, 0.2
    admitted(forecast, 0.0, 11)
    assert forecast.slot_free_at(0.05, 1, None) == pytest.approx(0.2 + 10 * 0.01)
    assert forecast.slot_free_at(0.195, 1, None) == pytest.approx(0.2 + 10 * 0.01)
    # past its usual first-token time, it is at least a step away from its first token
    assert forecast.slot_free_at(0.5, 1, None) == pytest.approx(0.5 + 0.01 + 10 * 0.01)


def test_an_early_end_of_sequence_is_learnt_as_a_length_ratio() -> None:
    forecast = ReleaseForecast()
    for k in range(40):  # every request stops after half of what it asked for
        grant, stream = admitted(forecast, k, 20)
        grant.ask.to_length = False  # (a frame that may end at an end of sequence)
        for i in range(10):
            stream.token(k + 0.1 + 0.01 * i)
        forecast.release(grant, True)
        forecast.ended(grant, True, k + 0.2)
    assert forecast.length_ratio == pytest.approx(0.5, abs=0.01)
    # from the first token (k + 0.1) to the last (k + 0.19): 9 steps of 10 ms
    assert forecast.models[ENDPOINT].step_s == pytest.approx((0.19 - 0.1) / 9)


def test_a_request_that_runs_to_its_length_is_forecast_at_all_of_it_and_teaches_no_share() -> None:
    """`ignore_eos` (`Ask.to_length`): its length is known; the share learnt from requests that
    may end at an end of sequence is not applied to it, nor taught by it."""
    endpoint = Endpoint("e", EndpointLimits(step_ms=10), now=0.0)
    forecast = ReleaseForecast()
    for k in range(20):  # requests that may end early run to half of theirs
        grant, stream = admitted(forecast, k, 20, endpoint=endpoint)
        grant.ask.to_length = False
        _stream(forecast, grant, stream, [k + 0.01 * (i + 1) for i in range(10)])
    share = forecast.length_ratio
    assert share < 0.6
    to_length, stream = admitted(forecast, 100.0, 20, endpoint=endpoint)
    may_end, _ = admitted(forecast, 100.0, 20, endpoint=endpoint)
    may_end.ask.to_length = False
    ends = sorted(forecast.slot_free_at(100.0, k, None) or 0.0 for k in (1, 2))
    assert ends == pytest.approx([100.0 + 20 * share * 0.01, 100.0 + 20 * 0.01])
    _stream(forecast, to_length, stream, [100.0 + 0.01 * (i + 1) for i in range(20)])
    assert forecast.length_ratio == share


def test_a_length_nobody_has_seen_is_forecast_short_and_the_promise_judged_on_all_of_it() -> None:
    """Before any request that may end early ended, it is forecast at `OPTIMISTIC_SHARE` of its
    `max_new_tokens` (hints come early: a hold in the lobby, not an idle server), and `stretch`
    says how much longer its time left is at the conservative share (all of it, before any end)."""
    endpoint = Endpoint("e", EndpointLimits(step_ms=10), now=0.0)
    forecast = ReleaseForecast()
    grant, _ = admitted(forecast, 0.0, 40, endpoint=endpoint)
    grant.ask.to_length = False
    tokens = 40 * OPTIMISTIC_SHARE
    # its first token a step on, then the rest a step each
    assert forecast.slot_free_at(0.0, 1, None) == pytest.approx(tokens * 0.01)
    assert forecast.stretch() == pytest.approx(40 / tokens)
    # a request that runs to its length is forecast at all of it, and stretches nothing
    forecast = ReleaseForecast()
    admitted(forecast, 0.0, 40, endpoint=endpoint)
    assert forecast.slot_free_at(0.0, 1, None) == pytest.approx(0.4)
    assert forecast.stretch() == 1.0


def test_the_two_shares_meet_at_their_mean_once_enough_requests_ended() -> None:
    """While few ended, the forecast takes the least of their mean and `OPTIMISTIC_SHARE`, the
    promise the average moving from 1; at `CONFIDENT_AFTER` both are their mean: no stretch."""
    endpoint = Endpoint("e", EndpointLimits(step_ms=10), now=0.0)
    forecast = ReleaseForecast()
    for k in range(CONFIDENT_AFTER):
        grant, stream = admitted(forecast, k, 20, endpoint=endpoint)
        grant.ask.to_length = False
        _stream(forecast, grant, stream, [k + 0.01 * (i + 1) for i in range(12)])  # 0.6 of 20
        waiting, _ = admitted(forecast, k + 0.5, 20, endpoint=endpoint)
        waiting.ask.to_length = False
        forecast.slot_free_at(k + 0.5, 1, None)
        if k < CONFIDENT_AFTER - 1:
            assert forecast.stretch() > 1.0
            assert forecast.length_ratio > 0.6  # the conservative one, from 1
        forecast.release(waiting, executed=False)
    assert forecast.length_ratio == pytest.approx(0.6)
    admitted(forecast, 100.0, 20, endpoint=endpoint)[0].ask.to_length = False
    assert forecast.slot_free_at(100.0, 1, None) == pytest.approx(100.0 + 12 * 0.01)
    assert forecast.stretch() == 1.0


def test_the_step_is_learnt_from_the_first_to_the_last_token_not_to_the_end() -> None:
    """The gap from a request's last token to its final reply (detokenising, the worker's
    bookkeeping, the network) is no decode step."""
    forecast = ReleaseForecast()
    grant, stream = admitted(forecast, 0.0, 3)
    for at in (1.0, 1.1, 1.2):
        stream.token(at)
    forecast.release(grant, True)
    forecast.ended(grant, True, 5.0)  # its end, long after its last token
    model = forecast.models[ENDPOINT]
    assert model.step_s == pytest.approx(0.1)  # (1.2 - 1.0) / 2, not (5.0 - 1.0) / 2
    # the gap is learnt apart, once per request (an EWMA from 0: a fifth of 3.8 s)
    assert model.end_gap_s == pytest.approx(0.2 * 3.8)
    # and the next request is forecast from both: its first token a step on, 4 more steps, the gap
    admitted(forecast, 10.0, 5)
    assert forecast.slot_free_at(10.0, 1, None) == pytest.approx(10.0 + 5 * 0.1 + 0.2 * 3.8)


def test_token_cost_released_over_time_is_the_running_sum_of_the_forecast_ends() -> None:
    forecast = ReleaseForecast()
    # admitted at 0.5, no stream seen: 5 and 9 tokens at the prior 0.1 s end at 1.0 and 1.4
    admitted(forecast, 0.5, 5, cost=30)
    admitted(forecast, 0.5, 9, cost=50)
    assert forecast.tokens_free_at(0.5, 30, 1.0) == pytest.approx(1.0)
    assert forecast.tokens_free_at(0.5, 31, 1.0) == pytest.approx(1.4)
    assert forecast.tokens_free_at(0.5, 80, 1.0) == pytest.approx(1.4)
    assert forecast.tokens_free_at(0.5, 110, 1.0) == pytest.approx(2.0)  # the next round


def test_the_first_forecast_of_a_request_is_scored_against_its_end() -> None:
    forecast = ReleaseForecast()
    grant, _ = admitted(forecast, 0.0, 10)
    assert forecast.slot_free_at(0.0, 1, 1.0) == pytest.approx(1.0)
    forecast.slot_free_at(0.5, 1, 3.0)  # a later, different forecast does not replace the first
    forecast.release(grant, True)
    forecast.ended(grant, True, 1.25)
    assert list(forecast.relative_errors) == [pytest.approx(0.2)]
    assert forecast.error.count == 1 and forecast.error.total == pytest.approx(-0.25)
    assert len(forecast) == 0


def test_the_list_is_recomputed_when_a_request_ends() -> None:
    forecast = ReleaseForecast()
    # admitted at 0.5, no stream seen: 5 and 10 tokens at the prior 0.1 s end at 1.0 and 1.5
    first, _ = admitted(forecast, 0.5, 5)
    admitted(forecast, 0.5, 10)
    assert forecast.slot_free_at(0.55, 1, 1.0) == pytest.approx(1.0)
    forecast.release(first, True)
    assert forecast.slot_free_at(0.55, 1, 1.0) == pytest.approx(1.5)


def test_an_endpoint_that_runs_one_at_a_time_is_a_queue_its_releases_one_after_another() -> None:
    """`batch=1` (a serial server): of three requests admitted together the first runs and the
    others wait in its queue, each starting when the one before it ends: their ends come one
    service apart, not together (as they would on a server that batches them)."""
    serial = Endpoint("serial", EndpointLimits(step_ms=10, batch=1), now=0.0)
    batching = Endpoint("batching", EndpointLimits(step_ms=10), now=0.0)
    for endpoint, expected in ((serial, [0.04, 0.08, 0.12]), (batching, [0.04, 0.04, 0.04])):
        forecast = ReleaseForecast()
        for _ in range(3):
            admitted(forecast, 0.0, 4, endpoint=endpoint)  # a first token a step on, then 3 more
        ends = [forecast.slot_free_at(0.0, k, None) for k in (1, 2, 3)]
        assert ends == pytest.approx(expected)


def test_a_queued_request_starts_when_the_running_one_ends_by_its_own_pace() -> None:
    serial = Endpoint("serial", EndpointLimits(step_ms=10, batch=1), now=0.0)
    forecast = ReleaseForecast()
    _, running = admitted(forecast, 0.0, 4, endpoint=serial)
    admitted(forecast, 0.0, 4, endpoint=serial)
    for at in (0.005, 0.025):  # it runs at 20 ms a token: two more to come, at 0.045 and 0.065
        running.token(at)
    assert forecast.slot_free_at(0.03, 1, None) == pytest.approx(0.065)
    assert forecast.slot_free_at(0.03, 2, None) == pytest.approx(0.065 + 4 * 0.01)


def _stream(forecast: ReleaseForecast, grant: Grant, stream: Stream, times: list[float]) -> None:
    for at in times:
        stream.token(at)
    forecast.release(grant, executed=True)
    forecast.ended(grant, True, times[-1])


def test_the_batch_of_a_server_that_queues_is_learnt_from_its_streams() -> None:
    """A serial server: one request streams while another, admitted long before, waits for its
    first token: it runs one at a time (`batch_seen` 1). A server that batches: two stream
    together and nobody waits long: no bound is learnt, every request admitted runs."""
    serial = Endpoint("serial", EndpointLimits(), now=0.0)
    forecast = ReleaseForecast()
    first, first_stream = admitted(forecast, 0.0, 4, endpoint=serial)
    second, second_stream = admitted(forecast, 0.0, 4, endpoint=serial)
    _stream(forecast, first, first_stream, [0.01, 0.02, 0.03, 0.04])
    assert forecast.model(serial).batch == 1
    _stream(forecast, second, second_stream, [0.05, 0.06, 0.07, 0.08])  # alone: it stays 1
    assert forecast.model(serial).batch == 1

    batching = Endpoint("batching", EndpointLimits(), now=0.0)
    forecast = ReleaseForecast()
    a, a_stream = admitted(forecast, 0.0, 4, endpoint=batching)
    b, b_stream = admitted(forecast, 0.0, 4, endpoint=batching)
    late, _ = admitted(forecast, 0.035, 4, endpoint=batching)  # admitted a step before a's last token
    for at in (0.01, 0.02, 0.03):
        a_stream.token(at)
        b_stream.token(at + 0.001)
    _stream(forecast, a, a_stream, [0.04])
    assert forecast.model(batching).batch == 0  # two streamed together, and `late` has not waited long
    assert late.progress is not None and late.progress.t_first_token is None


def test_the_token_cost_of_one_tenants_requests_comes_back_at_their_own_ends() -> None:
    """`among`: a tenant's own token cap counts only its requests' cost (the others' free none of it)."""
    forecast = ReleaseForecast()
    forecast.cost_groups = True  # (as admission sets it when such a cap books its first appointment)
    mine, other = object(), object()
    for tokens, cost, tenant in ((2, 50, other), (4, 30, mine), (6, 30, mine)):
        grant, _ = admitted(forecast, 0.0, tokens, cost=cost)
        grant.ask.tenant = tenant  # type: ignore[assignment]
    assert forecast.tokens_free_at(0.0, 50, None) == pytest.approx(2 * PRIOR_STEP_S)  # anyone's
    assert forecast.tokens_free_at(0.0, 50, None, among=mine) == pytest.approx(6 * PRIOR_STEP_S)
    assert forecast.tokens_free_at(0.0, 30, None, among=mine) == pytest.approx(4 * PRIOR_STEP_S)
