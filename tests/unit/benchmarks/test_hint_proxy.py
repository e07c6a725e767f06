"""benchmarks/harness/hint_proxy.py: llm-d's Retry-After rule (its drain estimator), the rewriting
of a 429's retry headers by each rival rule, and the proxy relaying a 429 and a stream on loopback."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import ClientSession, web
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.harness.hint_proxy import (
    CONSTANT,
    FINAL,
    LLMD,
    NONE,
    OURS,
    POLICIES,
    RETRY_HEADERS,
    DrainEstimator,
    app,
    rewrite,
)

# The governor's retryable 429, as doors/http_wire.py writes it (values made up).
GOVERNOR_429 = [
    ("content-type", "application/json"),
    ("x-should-retry", "true"),
    ("x-governor-dropped-reason", "inflight"),
    ("retry-after-ms", "137"),
    ("Retry-After", "1"),
    ("retry-ticket", "00ff"),
]


def test_no_hint_before_any_dispatch_was_measured() -> None:
    drain = DrainEstimator(last_fold=0.0)
    assert drain.current(0.5) is None and drain.retry_after_s(0.5) is None
    drain.maybe_fold(3.0)  # a fold over nothing: measured, at zero
    assert drain.current(3.0) == 0.0 and drain.retry_after_s(3.0) is None


def test_a_slow_drain_gives_whole_seconds_rounded_up_and_a_fast_one_none() -> None:
    drain = DrainEstimator(last_fold=0.0)
    drain.record_dispatch()
    drain.maybe_fold(1.0)  # 1 dispatch in 1 s: rate 0.3 x 1 = 0.3/s, a slot in 3.33 s
    assert drain.rate == pytest.approx(0.3)
    assert drain.retry_after_s(1.0) == 4
    for _ in range(8):
        drain.record_dispatch()
    # the current window's 8 in 0.5 s (16/s) raise the decayed EWMA: a slot in 1/16 s, no header
    assert drain.current(1.5) == pytest.approx(16.0)
    assert drain.retry_after_s(1.5) is None


def test_the_hint_is_capped_at_30_s() -> None:
    drain = DrainEstimator(last_fold=0.0)
    drain.record_dispatch()
    drain.maybe_fold(100.0)  # 1 in 100 s: 0.003/s, a slot in 333 s
    assert drain.retry_after_s(100.0) == 30


def test_folds_no_more_than_once_per_interval() -> None:
    drain = DrainEstimator(last_fold=0.0)
    drain.record_dispatch()
    drain.maybe_fold(0.99)
    assert not drain.folded and drain.count == 1
    drain.maybe_fold(2.0)  # the window's count over its whole length
    assert drain.folded and drain.count == 0 and drain.rate == pytest.approx(0.3 * 1 / 2.0)


@given(st.lists(st.tuples(st.floats(0.01, 3.0), st.integers(0, 20)), min_size=1, max_size=40))
def test_a_hint_is_absent_or_whole_seconds_in_1_to_30_and_one_slot_s_wait(steps: list[tuple[float, int]]) -> None:
    drain, now = DrainEstimator(last_fold=0.0), 0.0
    for gap, dispatches in steps:
        for _ in range(dispatches):
            drain.record_dispatch()
        now += gap
        drain.maybe_fold(now)
        hint = drain.retry_after_s(now)
        rate = drain.current(now)
        if hint is None:
            assert rate is None or rate == 0 or 1 / rate < 1
        else:
            assert rate is not None and 1 <= hint <= 30
            assert hint == min(30, math.ceil(1 / rate))


def values(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers}


def test_ours_passes_the_governor_s_headers_as_they_are() -> None:
    assert rewrite(OURS, GOVERNOR_429) == GOVERNOR_429


def test_constant_tells_one_second_and_to_retry() -> None:
    out = values(rewrite(CONSTANT, GOVERNOR_429))
    assert (out["retry-after-ms"], out["retry-after"], out["x-should-retry"]) == ("1000", "1", "true")
    assert "retry-ticket" not in out


def test_llm_d_sends_its_whole_seconds_only_or_nothing() -> None:
    assert values(rewrite(LLMD, GOVERNOR_429, 4)).keys() & RETRY_HEADERS == {"retry-after"}
    assert values(rewrite(LLMD, GOVERNOR_429, 4))["retry-after"] == "4"
    assert not values(rewrite(LLMD, GOVERNOR_429, None)).keys() & RETRY_HEADERS


def test_none_strips_every_retry_header_and_final_says_do_not_retry() -> None:
    assert not values(rewrite(NONE, GOVERNOR_429)).keys() & RETRY_HEADERS
    final = values(rewrite(FINAL, GOVERNOR_429))
    assert final.keys() & RETRY_HEADERS == {"x-should-retry"} and final["x-should-retry"] == "false"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_rule_keeps_the_other_headers_in_order(policy: str) -> None:
    others = [(n, v) for n, v in rewrite(policy, GOVERNOR_429, 2) if n.lower() not in RETRY_HEADERS]
    assert others == [("content-type", "application/json"), ("x-governor-dropped-reason", "inflight")]


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown hint policy"):
        rewrite("sometimes", GOVERNOR_429)


async def upstream(request: web.Request) -> web.StreamResponse:
    """A stand-in front door: a 429 with the governor's headers for "full", else a two-chunk stream."""
    body = await request.read()
    if body == b"full":
        json = "application/json"
        return web.Response(status=429, headers=GOVERNOR_429[1:], body=b'{"error": {}}', content_type=json)
    out = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await out.prepare(request)
    for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
        await out.write(chunk)
    await out.write_eof()
    return out


async def through(policy: str) -> tuple[dict[str, str], bytes]:
    """One 429 and one stream through a proxy of `policy`: the 429's headers, the stream's body."""
    origin = web.Application()
    origin.router.add_route("POST", "/v1/completions", upstream)
    runners = [web.AppRunner(origin)]
    await runners[0].setup()
    site = web.TCPSite(runners[0], "127.0.0.1", 0)
    await site.start()
    port = runners[0].addresses[0][1]
    runners.append(web.AppRunner(app(f"http://127.0.0.1:{port}", policy)))
    await runners[1].setup()
    await web.TCPSite(runners[1], "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runners[1].addresses[0][1]}/v1/completions"
    try:
        async with ClientSession() as client:
            async with client.post(url, data=b"full") as refused:
                assert refused.status == 429 and await refused.read() == b'{"error": {}}'
                headers = {k.lower(): v for k, v in refused.headers.items()}
            async with client.post(url, data=b"go") as served:
                assert served.status == 200
                return headers, await served.read()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


@pytest.mark.parametrize("policy", [OURS, CONSTANT, FINAL])
def test_the_proxy_rewrites_a_429_and_relays_a_stream_whole(policy: str) -> None:
    headers, streamed = asyncio.run(through(policy))
    assert streamed == b"data: 1\n\ndata: [DONE]\n\n"
    expected = values(rewrite(policy, GOVERNOR_429[1:]))
    assert {k: v for k, v in headers.items() if k in RETRY_HEADERS} == {
        k: v for k, v in expected.items() if k in RETRY_HEADERS
    }
