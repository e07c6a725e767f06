"""One admission decision over every limit: the pool's hard caps over each endpoint's soft ones,
all-or-nothing, on a simulated clock."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from governor.admission.appointments.books import MIN_TRUST, PROBE_EVERY, PrepaidBook
from governor.admission.buckets import TokenBucket
from governor.admission.caps import Caps
from governor.admission.cost import Ask
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.limits import Grant, Refusal
from governor.admission.priority import STANDARD_RANK
from governor.admission.tenant import TenantLimits
from govwire.vocab import YieldReason
from tests.fakes import make_state, unspent


def admission(
    *limits: EndpointLimits, qps: float = 0.0, burst: float = 0.0, capacity: int = 100, max_inflight: int = 1000
) -> Admission:
    endpoints = [Endpoint(f"e{i}", lim, now=0.0) for i, lim in enumerate(limits)]
    for e in endpoints:
        e.up = True
    hints = RetryHintEstimator(RetryHintPolicy(jitter=0.0, base_ms=40), max_inflight)
    a = Admission(endpoints, Caps(max_inflight=max_inflight, max_qps=qps, qps_burst=burst), hints, now=0.0)
    a.pool.default_capacity = capacity
    return a


def routed(decision: Grant | Refusal) -> Endpoint:
    assert isinstance(decision, Grant) and decision.endpoint is not None, decision
    return decision.endpoint


def refused(decision: Grant | Refusal) -> tuple[str, int]:
    assert isinstance(decision, Refusal), decision
    return decision.reason, decision.hint_ms


def test_the_bucket_refills_at_its_rate_and_says_exactly_when_the_next_token_comes() -> None:
    b = TokenBucket(rate=10.0, burst=2.0, now=0.0)
    b.take()
    b.take()
    assert b.wait_s(0.0) == pytest.approx(0.1)
    assert b.wait_s(0.05) == pytest.approx(0.05)
    assert b.level(1.0) == 2.0  # never above the burst


def test_load_follows_the_endpoint_caps_and_weights() -> None:
    a = admission(EndpointLimits(concurrency=1), EndpointLimits(concurrency=3), EndpointLimits(weight=2.0), capacity=2)
    # relative load = inflight / (cap * weight); an uncapped endpoint counts the default capacity (2)
    picks = [routed(a.decide(0.0)) for _ in range(8)]
    assert [e.name for e in picks] == ["e0", "e1", "e2", "e2", "e1", "e2", "e1", "e2"]
    assert [e.inflight for e in a.pool.endpoints] == [1, 3, 4]  # each at its share: 1/1, 3/3, 4/(2*2)
    assert routed(a.decide(0.0)) is a.pool.endpoints[2]  # the capped ones are full; the uncapped one takes the rest


def test_equal_endpoints_take_turns() -> None:
    a = admission(EndpointLimits(), EndpointLimits(), EndpointLimits())
    names = []
    for _ in range(6):
        grant = a.decide(0.0)
        names.append(routed(grant).name)
        a.release(grant, executed=True)  # type: ignore[arg-type]
    assert names == ["e0", "e1", "e2", "e0", "e1", "e2"]


def test_each_limit_names_itself_and_a_refusal_charges_nothing() -> None:
    a = admission(EndpointLimits(concurrency=1, step_ms=30), EndpointLimits(qps=1.0), qps=100.0, burst=3.0)
    first, second = a.decide(0.0), a.decide(0.0)
    routed(first), routed(second)
    assert refused(a.decide(0.0)) == (YieldReason.ENDPOINT_QPS, 1000)  # e0 full, e1 out of tokens
    bucket = a.rate.bucket
    assert bucket is not None and bucket.level(0.0) == 1.0  # the refused request took no pool token
    e1 = a.pool.endpoints[1]
    e1.bucket, e1.limits = None, EndpointLimits(concurrency=1)
    # the next forecast release: `first`, on e0, asks no tokens, so one (its first) a step (e0's
    # step_ms=30) after its admission at 0.0; `second`, on e1, one at the default prior (100 ms)
    assert refused(a.decide(0.0)) == (YieldReason.ENDPOINT_INFLIGHT, 30)
    a.release(first, executed=True)  # type: ignore[arg-type]
    third = a.decide(0.0)  # the pool's last token
    routed(third)
    a.release(third, executed=True)  # type: ignore[arg-type]
    assert refused(a.decide(0.0)) == (YieldReason.QPS, 10)
    assert a.pool.endpoints[0].inflight == 0 and a.inflight.inflight == 1


def test_the_global_cap_and_draining_come_before_the_pool() -> None:
    a = admission(EndpointLimits(concurrency=1), max_inflight=1)
    routed(a.decide(0.0))
    assert refused(a.decide(0.0))[0] == YieldReason.INFLIGHT  # the endpoint is full too: global first
    a.start_draining()
    assert refused(a.decide(0.0))[0] == YieldReason.DRAINING


def test_with_no_endpoint_up_a_request_is_admitted_without_one() -> None:
    a = admission(EndpointLimits(), EndpointLimits())
    a.pool.endpoints[0].up = False
    assert all(routed(a.decide(0.0)) is a.pool.endpoints[1] for _ in range(3))
    a.pool.endpoints[1].up = False
    grant = a.decide(0.0)  # dispatch then answers worker_unavailable
    assert isinstance(grant, Grant) and grant.endpoint is None and a.inflight.inflight == 4
    a.release(grant, executed=False)
    assert a.inflight.inflight == 3


def test_refund_returns_the_tokens_of_an_unused_grant() -> None:
    a = admission(EndpointLimits(qps=5.0, burst=1.0), qps=5.0, burst=1.0)
    grant = a.decide(0.0)
    routed(grant)
    a.refund(grant)  # type: ignore[arg-type]
    a.release(grant, executed=False)  # type: ignore[arg-type]
    routed(a.decide(0.0))  # both buckets had their token back


ENDPOINTS = st.lists(
    st.builds(
        EndpointLimits,
        concurrency=st.integers(0, 4),
        qps=st.sampled_from([0.0, 2.0, 5.0, 50.0]),
        burst=st.sampled_from([0.0, 1.0, 3.0]),
        weight=st.sampled_from([1.0, 2.0]),
    ),
    min_size=1,
    max_size=4,
)
EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "arrive", "return", "finish", "tick", "flip"]), st.integers(0, 10**6)
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ENDPOINTS, st.integers(1, 6), st.sampled_from([0.0, 3.0, 20.0]), st.sampled_from([0.0, 1.0, 4.0]), EVENTS)
# Two no-shows' tokens given back while a later appointment was still owed its own let a newcomer
# in beside it, past the rate (rate caps no longer give back what they were paid):
@example([EndpointLimits()], 3, 20.0, 1.0, [("arrive", 0)] * 4 + [("tick", 300), ("arrive", 0), ("return", 482)])
@example([EndpointLimits(concurrency=1)], 2, 20.0, 1.0, [("arrive", 0)] * 3 + [("tick", 200), ("return", 1)])
def test_no_limit_is_ever_exceeded_and_refusals_leave_no_trace(
    limits: list[EndpointLimits], max_inflight: int, qps: float, burst: float, events: list[tuple[str, int]]
) -> None:
    """Whatever arrives, returns with a ticket, ends or ticks: no cap is exceeded, no bucket admits
    past its rate (returns to a rate cap's prepaid appointments included), and a refusal changes
    nothing but where a rate cap's tokens sit (its appointment moves them from the bucket into its
    book: what is unspent stays the same) and what a holder refused in its time had paid (spent)."""
    a = admission(*limits, qps=qps, burst=burst, capacity=max_inflight, max_inflight=max_inflight)
    endpoints = a.pool.endpoints
    now = 0.0
    running: list[Grant] = []
    # When, where, the book that paid for it at its appointment (if one did) and that appointment.
    admitted: list[tuple[float, Endpoint | None, object, float]] = []
    tickets: list[str] = []

    def levels() -> list[float | None]:
        return [unspent(a.rate.bucket, a.rate.book, now), *(unspent(e.bucket, e.qps_book, now) for e in endpoints)]

    for kind, n in events:
        if kind == "tick":
            now += (n % 1000) / 2000  # up to 0.5 s
        elif kind == "flip":
            e = endpoints[n % len(endpoints)]
            e.up = not e.up
        elif kind == "finish" and running:
            a.release(running.pop(n % len(running)), executed=True)
        elif kind in ("arrive", "return"):
            ask = Ask()
            if kind == "return" and tickets:
                ask.ticket = tickets.pop(n % len(tickets))
            a.appointments.tidy(now)  # (what lapses gives its tokens back before, not during, the decision)
            before = (levels(), [e.inflight for e in endpoints], a.inflight.inflight)
            got = a.decide(now, ask)
            if isinstance(got, Grant):
                running.append(got)
                # A holder's tokens were set aside for it at its appointment: the bucket that
                # paid counts them spent then, even if the holder comes later in its window.
                held = ask.appointment
                if held is not None and isinstance(held.book, PrepaidBook) and held.at <= now:
                    admitted.append((now, got.endpoint, held.book, held.at))
                else:
                    admitted.append((now, got.endpoint, None, now))
            else:
                held = ask.appointment
                if got.appointment is not None and got.appointment is not held:
                    tickets.append(got.appointment.ticket)
                expected = list(before[0])
                if (
                    held is not None
                    and isinstance(held.book, PrepaidBook)
                    and held is not got.appointment
                    and held.ticket not in a.appointments.by_ticket
                ):  # a holder refused elsewhere in its time, or taken over: what it paid is spent
                    books = [a.rate.book, *(e.qps_book for e in endpoints)]
                    index = books.index(held.book)
                    expected[index] = round(expected[index] - held.amount, 9)  # type: ignore[operator]
                assert (levels(), [e.inflight for e in endpoints], a.inflight.inflight) == (expected, *before[1:])
        assert a.inflight.inflight <= max_inflight and a.inflight.inflight == len(running)
        assert sum(e.inflight for e in endpoints) == sum(g.endpoint is not None for g in running)
        for e in endpoints:
            assert not e.limits.concurrency or e.inflight <= e.limits.concurrency
    # admissions in any window [t_i, t_j] never exceed rate * (t_j - t_i) + burst
    windows: list[tuple[float, float, list[float]]] = []
    if qps:
        times = sorted(at if book is a.rate.book else t for t, _, book, at in admitted)
        windows.append((qps, burst or max(1.0, qps), times))
    for e in endpoints:
        if e.limits.qps:
            times = sorted(at if book is e.qps_book else t for t, x, book, at in admitted if x is e)
            windows.append((e.limits.qps, e.limits.burst or max(1.0, e.limits.qps), times))
    for rate, allowance, times in windows:
        for i in range(len(times)):
            for j in range(i, len(times)):
                assert j - i + 1 <= rate * (times[j] - times[i]) + allowance + 1e-9


def test_clients_refused_together_are_told_successive_tokens() -> None:
    a = admission(EndpointLimits(), qps=10.0, burst=1.0)
    routed(a.decide(0.0))
    hints, tickets = [], []
    for _ in range(3):
        answer = a.decide(0.02)  # (a Refusal is reused: read at once)
        hints.append(refused(answer)[1])
        assert isinstance(answer, Refusal) and answer.appointment is not None  # paid for at once, kept
        tickets.append(answer.appointment.ticket)
    assert hints == [80, 180, 280]  # the next token, and the two after it
    assert refused(a.decide(0.1)) == ("qps", 300)  # a newcomer finds the tokens promised: told after them
    first = Ask()
    first.ticket = tickets[0]
    routed(a.decide(0.1, first))  # the first one, back on time, gets its token


def back(ticket: str, cost: int = 0) -> Ask:
    ask = Ask(cost=cost)
    ask.ticket = ticket
    return ask


def test_a_rate_appointment_nobody_comes_for_spends_its_token() -> None:
    """What an appointment paid never goes back: the appointments booked after it were told times
    that count it taken, and a newcomer let in ahead of them would put the cap past its rate."""
    a = admission(EndpointLimits(), qps=10.0, burst=1.0)
    routed(a.decide(0.0))
    no_show = a.decide(0.0)
    assert refused(no_show) == ("qps", 100) and isinstance(no_show, Refusal) and no_show.appointment is not None
    second = a.decide(0.12)  # the no-show's token is paid for: told the next one
    assert refused(second) == ("qps", 80) and isinstance(second, Refusal) and second.appointment is not None
    ticket = second.appointment.ticket
    assert refused(a.decide(0.2)) == ("qps", 100)  # the no-show's window closed: its token stays spent
    routed(a.decide(0.2, back(ticket)))  # the second client, on time, with the token it paid for
    assert a.appointments.outcomes[("qps", "on_time")] == 1


def test_a_rate_holder_is_let_in_from_its_time_not_before_and_pays_once() -> None:
    a = admission(EndpointLimits(), qps=10.0, burst=1.0)
    routed(a.decide(0.0))
    answer = a.decide(0.0)
    assert isinstance(answer, Refusal) and answer.hint_ms == 100 and answer.appointment is not None
    ticket = answer.appointment.ticket
    assert refused(a.decide(0.09, back(ticket))) == ("qps", 10)  # early: the time left, its place kept
    routed(a.decide(0.1, back(ticket)))
    bucket = a.rate.bucket
    assert bucket is not None and bucket.level(0.1) == pytest.approx(0.0)  # paid once, at its refusal
    assert a.appointments.outcomes == {("qps", "early"): 1, ("qps", "on_time"): 1}


def test_a_rate_holder_another_limit_refuses_spends_its_token() -> None:
    a = admission(EndpointLimits(concurrency=1), qps=10.0, burst=1.0)
    first = a.decide(0.0)
    answer = a.decide(0.0)
    assert isinstance(answer, Refusal) and answer.reason == "qps" and answer.appointment is not None
    ticket = answer.appointment.ticket
    assert refused(a.decide(0.1, back(ticket)))[0] == "endpoint_inflight"  # its slot is still taken
    bucket = a.rate.bucket
    assert bucket is not None and bucket.level(0.1) == pytest.approx(0.0)  # its token was spent
    assert a.appointments.outcomes[("qps", "refused_elsewhere")] == 1
    a.release(first, executed=True)  # type: ignore[arg-type]


def test_a_token_rate_refusal_past_the_horizon_is_final_and_pays_nothing() -> None:
    a = Admission(
        [], Caps(max_inflight=100), RetryHintEstimator(RetryHintPolicy(jitter=0.0, horizon_ms=1000), 100), 0.0
    )
    a.set_caps(Caps(max_inflight=100, max_tokens_per_s=100.0, tokens_burst=100.0), 0.0)
    assert isinstance(a.decide(0.0, Ask(cost=100)), Grant)
    promised = a.decide(0.0, Ask(cost=50))  # 0.5 s away: paid for and kept
    assert isinstance(promised, Refusal) and promised.hint_ms == 500 and promised.appointment is not None
    assert not promised.final and promised.appointment.amount == 50
    final = a.decide(0.0, Ask(cost=60))  # 1.1 s away, past the horizon: told so, nothing paid
    assert isinstance(final, Refusal) and final.final and final.appointment is None
    bucket = a.token_rate.bucket
    assert bucket is not None and bucket.level(0.0) == pytest.approx(-50.0)


def test_a_token_rate_holder_asking_for_more_than_it_paid_for_is_a_new_request() -> None:
    policy = RetryHintPolicy(jitter=0.0, horizon_ms=5000)
    a = Admission([], Caps(max_inflight=100), RetryHintEstimator(policy, 100), 0.0)
    a.set_caps(Caps(max_inflight=100, max_tokens_per_s=100.0, tokens_burst=100.0), 0.0)
    assert isinstance(a.decide(0.0, Ask(cost=100)), Grant)
    answer = a.decide(0.0, Ask(cost=1))  # paid for 1 token, at 10 ms
    assert isinstance(answer, Refusal) and answer.hint_ms == 10 and answer.appointment is not None
    ticket = answer.appointment.ticket
    greedy = a.decide(0.01, back(ticket, cost=100))  # the same ticket, for 100 tokens
    # Its 1 token back (the level at 1 with 10 ms of refill), then 99 short: 990 ms, paid for.
    assert isinstance(greedy, Refusal) and greedy.reason == "token_rate" and greedy.hint_ms == 990
    bucket = a.token_rate.bucket
    assert bucket is not None and bucket.level(0.01) == pytest.approx(-99.0)
    assert a.appointments.outcomes[("token_rate", "yielded_again")] == 1


def test_while_a_flood_never_comes_back_rate_probes_pay_nothing() -> None:
    a = admission(EndpointLimits(), qps=10.0, burst=1.0)
    book = a.rate.book
    bucket = a.rate.bucket
    assert book is not None and bucket is not None
    book.trust[STANDARD_RANK] = MIN_TRUST / 2  # (what a flood of no-shows leaves)
    routed(a.decide(0.0))
    booked = []
    for _ in range(PROBE_EVERY):
        answer = a.decide(0.0)
        assert isinstance(answer, Refusal) and answer.hint_ms == 100  # the exact wait, unpaid
        booked.append(answer.appointment)
    probe = booked[-1]
    assert booked[:-1] == [None] * (PROBE_EVERY - 1) and probe is not None and probe.amount == 0
    assert bucket.level(0.0) == 0.0  # nothing paid: the flood's probes cost no tokens
    routed(a.decide(0.1, back(probe.ticket)))  # its client came back: admitted with the bucket's token
    assert a.appointments.outcomes[("qps", "on_time")] == 1 and book.trust[STANDARD_RANK] > MIN_TRUST / 2


def test_a_rate_switched_off_takes_its_appointments_with_it() -> None:
    a = admission(EndpointLimits(), qps=10.0, burst=1.0)
    routed(a.decide(0.0))
    answer = a.decide(0.0)
    assert isinstance(answer, Refusal) and answer.appointment is not None
    ticket = answer.appointment.ticket
    a.set_caps(Caps(max_inflight=1000), 0.0)  # no --max-qps: the token it paid went with the bucket
    a.set_caps(Caps(max_inflight=1000, max_qps=10.0, qps_burst=1.0), 0.05)  # back on: a fresh bucket, full
    routed(a.decide(0.1))  # a newcomer takes the one token
    assert refused(a.decide(0.1, back(ticket)))[0] == "qps"  # the old ticket is nobody's: no free pass


def test_an_endpoint_qps_holder_goes_to_the_endpoint_that_paid_for_its_token() -> None:
    a = admission(EndpointLimits(qps=10.0, burst=1.0), EndpointLimits(qps=10.0, burst=1.0))
    assert {routed(a.decide(0.0)).name, routed(a.decide(0.01)).name} == {"e0", "e1"}  # e0 refills first
    answer = a.decide(0.02)
    assert isinstance(answer, Refusal) and answer.reason == "endpoint_qps" and answer.hint_ms == 80
    assert answer.appointment is not None
    ticket = answer.appointment.ticket
    assert refused(a.decide(0.1))[0] == "endpoint_qps"  # e0's token at 0.1 is its holder's
    assert routed(a.decide(0.1, back(ticket))).name == "e0"
    assert a.appointments.outcomes[("endpoint_qps", "on_time")] == 1


@pytest.mark.parametrize(
    "bad", [{"burst": 0.5}, {"qps": math.nan}, {"weight": math.inf}, {"weight": 0.0}, {"concurrency": -1}]
)
def test_limits_that_cannot_work_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="endpoint limits"):
        EndpointLimits(**bad)  # type: ignore[arg-type]


def test_a_reroute_takes_an_endpoint_slot_but_not_a_second_global_token() -> None:
    a = admission(EndpointLimits(), EndpointLimits(), qps=1.0, burst=1.0)
    grant = a.decide(0.0)
    lost = routed(grant)
    assert refused(a.decide(0.0))[0] == YieldReason.QPS  # the global token is spent
    lost.up = False
    assert a.reroute(grant, 0.0)  # type: ignore[arg-type]
    other = routed(grant)
    assert other is not lost and (lost.inflight, other.inflight) == (0, 1)  # (its failure: Lifecycle.lose)
    assert a.inflight.inflight == 1  # still one request, holding one global slot
    other.up = False
    assert not a.reroute(grant, 0.0)  # type: ignore[arg-type]
    assert routed(grant) is other  # nowhere to go: nothing changed


def test_a_reroute_of_a_request_admitted_on_an_appointment_books_nothing_and_redeems_nothing_twice() -> None:
    """A request let in on its endpoint_tokens appointment loses its endpoint: the re-route asks
    the pool without booking (nobody would come back for it), finds no room, and changes nothing;
    its appointment, redeemed at its admission, is not redeemed again."""
    a = admission(EndpointLimits(tokens=100), EndpointLimits(tokens=100))
    first, second = (a.decide(0.0, Ask(cost=60, max_new_tokens=4)) for _ in range(2))
    assert isinstance(first, Grant) and isinstance(second, Grant)
    refused = a.decide(0.0, Ask(cost=60, max_new_tokens=4))
    assert isinstance(refused, Refusal) and refused.reason == "endpoint_tokens"
    booked = refused.appointment
    assert booked is not None
    a.release(first, True, 0.4)  # at its forecast end: 4 tokens at the prior step
    back = Ask(cost=60, max_new_tokens=4)
    back.ticket = booked.ticket
    holder = a.decide(0.4, back)
    assert isinstance(holder, Grant) and a.appointments.outcomes[("endpoint_tokens", "on_time")] == 1
    place = routed(holder)
    place.up = False
    assert not a.reroute(holder, 0.4)  # the other endpoint is full
    assert routed(holder) is place and place.inflight == 1 and place.tokens == 60
    assert not a.appointments.by_ticket  # nothing booked by the re-route's question


def test_an_endpoint_inflight_hint_is_the_forecast_release_at_the_full_endpoint() -> None:
    # 32 global slots, but one endpoint capped at 2: the next slot there frees when one of its two
    # requests ends (a service time after their admission), told in turn to the clients refused.
    endpoint = Endpoint("e", EndpointLimits(concurrency=2), 1000.0)
    endpoint.up = True
    state = make_state(max_inflight=32, endpoints=[endpoint], hint_policy=RetryHintPolicy(jitter=0.0))
    state.admission.hints.observe_service_time(0.1)
    assert not isinstance(state.admission.decide(1000.0), Refusal)
    assert not isinstance(state.admission.decide(1000.05), Refusal)
    hints, booked = [], []
    for _ in range(3):
        refusal = state.admission.decide(1000.05)
        assert isinstance(refusal, Refusal) and refusal.reason == "endpoint_inflight"
        hints.append(refusal.hint_ms)
        booked.append(refusal.appointment)
    # the first's end, the second's, then the first slot's next round (its holder's request, a
    # service time and a millisecond after it starts), each told a millisecond early ("be here
    # by", with the lobby) and each an appointment of the endpoint's book
    assert hints == [49, 99, 149]
    assert all(a is not None and a.book is state.admission.pool.book for a in booked)


def test_an_endpoint_keeps_the_slot_it_promised_for_its_holder() -> None:
    endpoint = Endpoint("e", EndpointLimits(concurrency=1, step_ms=10), 1000.0)
    endpoint.up = True
    state = make_state(max_inflight=32, endpoints=[endpoint], hint_policy=RetryHintPolicy(jitter=0.0))
    admission = state.admission
    first = admission.decide(1000.0, Ask(max_new_tokens=4))
    assert isinstance(first, Grant)
    refused = admission.decide(1000.0, Ask(max_new_tokens=4))
    assert isinstance(refused, Refusal) and refused.reason == "endpoint_inflight" and refused.hint_ms == 39
    holder = refused.appointment
    assert holder is not None
    admission.release(first, True, 1000.04)  # the slot frees at its time
    newcomer = admission.decide(1000.04, Ask(max_new_tokens=4))
    assert isinstance(newcomer, Refusal) and newcomer.reason == "endpoint_inflight"  # kept for the holder
    back = Ask(max_new_tokens=4)
    back.ticket = holder.ticket
    assert isinstance(admission.decide(1000.041, back), Grant)  # the holder gets it
    assert admission.appointments.outcomes[("endpoint_inflight", "on_time")] == 1


def fixed_hints(max_inflight: int, endpoint: EndpointLimits | None = None, **caps: Any) -> Admission:
    """With `--retry-hint fixed` (hints of 40 ms, no jitter), over one endpoint, a service time
    known: every forecast would have something to forecast from."""
    e = Endpoint("e", endpoint or EndpointLimits(), 1000.0)
    e.up = True
    policy = RetryHintPolicy(adaptive=False, jitter=0.0, base_ms=40)
    admission = make_state(max_inflight=max_inflight, endpoints=[e], hint_policy=policy, **caps).admission
    admission.hints.observe_service_time(0.4)
    return admission


def test_a_tenant_past_its_share_is_told_its_turn_and_let_in_at_it() -> None:
    """Past the threshold a tenant ahead of the others' counters yields `tenant_share` with an
    appointment: when the others will have caught up, at the rate the held tokens drain. Back in
    its window it is let in although still ahead (its turn, as told); a frame without it is not."""
    e = Endpoint("e", EndpointLimits(), 0.0)
    e.up = True
    policy = RetryHintPolicy(jitter=0.0, horizon_ms=5000)
    tenants = {"a": TenantLimits(), "b": TenantLimits()}
    admission = make_state(max_inflight=100, endpoints=[e], hint_policy=policy, tenants=tenants, share_threshold=0.0)
    a = admission.admission
    a.hints.observe_service_time(1.0)
    ta, tb = a.tenants.resolve("a"), a.tenants.resolve("b")
    for who in (ta, tb, ta, ta):  # a at 10, b lifted to a's 10 then 20, a at 20, then 30
        assert isinstance(a.decide(0.0, Ask(cost=10, tenant=who)), Grant)
    answer = a.decide(0.0, Ask(cost=10, tenant=ta))
    # 10 ahead of b, two tenants contending, 40 tokens held draining over 1 s: (10 x 2) / 40 s,
    # less the millisecond of "be here by"
    assert isinstance(answer, Refusal) and answer.reason == "tenant_share" and answer.hint_ms == 499
    assert answer.appointment is not None and not answer.final
    ticket = answer.appointment.ticket
    assert refused(a.decide(0.499, Ask(cost=10, tenant=ta)))[0] == "tenant_share"  # a newcomer of a's: not its turn
    turn = back(ticket, cost=10)
    turn.tenant = ta
    assert isinstance(a.decide(0.499, turn), Grant)
    assert a.appointments.outcomes[("tenant_share", "on_time")] == 1


def test_with_fixed_hints_every_capacity_refusal_hints_the_base_value() -> None:
    told: dict[str, list[int]] = {}

    def ask(admission: Admission, times: int, cost: int = 1, tenant: str | None = None) -> None:
        for _ in range(times):
            who = None if tenant is None else admission.tenants.resolve(tenant)
            decision = admission.decide(1000.0, Ask(cost=cost, tenant=who))
            if isinstance(decision, Refusal):
                assert decision.appointment is None  # nothing booked either
                told.setdefault(decision.reason, []).append(decision.hint_ms)

    ask(fixed_hints(2), 5)  # inflight
    ask(fixed_hints(32, max_inflight_tokens=100), 3, cost=60)  # tokens
    ask(fixed_hints(32, EndpointLimits(concurrency=2)), 5)  # endpoint_inflight (the forecast: 400 ms)
    ask(fixed_hints(32, EndpointLimits(tokens=100)), 3, cost=60)  # endpoint_tokens
    capped = fixed_hints(32, tenants={"a": TenantLimits(max_inflight=2), "b": TenantLimits(max_inflight_tokens=100)})
    ask(capped, 5, tenant="a")  # tenant_inflight (the forecast of a's own requests: 400 ms)
    ask(capped, 3, cost=60, tenant="b")  # tenant_tokens
    shared = fixed_hints(32, tenants={"a": TenantLimits(), "b": TenantLimits()}, share_threshold=0.0)
    ask(shared, 1, cost=10, tenant="a")
    ask(shared, 4, cost=10, tenant="b")  # b, lifted to a's counter, gets one in: then tenant_share (400 ms)
    full = fixed_hints(2, tenants={"a": TenantLimits(), "b": TenantLimits()})
    ask(full, 3, tenant="a")  # inflight, between tenants (the fair share re-hints it)
    ask(full, 2, tenant="b")
    assert told == {
        "inflight": [40] * 6,
        "tokens": [40] * 2,
        "endpoint_inflight": [40] * 3,
        "endpoint_tokens": [40] * 2,
        "tenant_inflight": [40] * 3,
        "tenant_tokens": [40] * 2,
        "tenant_share": [40] * 3,
    }
