"""Probing an OpenAI-compatible endpoint as it comes up (governor/links/endpoint_probe.py): what the
probes measure of a server that runs one at a time and of one that runs them together, that they
run before the endpoint takes traffic, and that a server that fails, hangs or sends garbage is up
all the same, its outcome counted. Scripted servers on loopback (tests/scripted_http.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson
import pytest

from governor.admission.endpoint import Endpoint, EndpointLimits, OpenAITarget, Probed
from governor.links import endpoint_probe
from governor.links.endpoint_probe import PROBE_TOKENS, ProbeStream, read_probes
from governor.links.health import HealthPolicy
from governor.links.openai_link import OpenAILink
from tests.scripted_http import Received, ScriptedServer, plain_response

STEP_S = 0.01
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class Server:
    """Streams `max_tokens` tokens STEP_S apart to each completion, `slots` at a time (the rest
    wait for a slot, as a server with that many slots queues them); records whether the endpoint
    was up when each completion came."""

    def __init__(self, slots: int, endpoint: Endpoint, answer: bytes | None = None) -> None:
        self.slots = asyncio.Semaphore(slots)
        self.endpoint = endpoint
        self.answer = answer  # instead of a stream: these bytes (an error, garbage), or hang if b""
        self.completions: list[tuple[dict[str, object], bool]] = []

    async def respond(self, request: Received, writer: asyncio.StreamWriter) -> bool | None:
        if request.path == "/health":
            writer.write(plain_response("200 OK", b"{}"))
            return None
        self.completions.append((orjson.loads(request.body), self.endpoint.up))
        if self.answer == b"":
            await asyncio.sleep(3600)
        if self.answer is not None:
            writer.write(self.answer)
            return False
        async with self.slots:
            writer.write(HEAD)
            for _ in range(int(orjson.loads(request.body)["max_tokens"])):
                await asyncio.sleep(STEP_S)
                writer.write(_chunk(b'{"choices":[{"text":"x"}]}'))
                await writer.drain()
            writer.write(_chunk(b"[DONE]") + b"0\r\n\r\n")
        return None


async def probed_link(
    slots: int, concurrency: int, answer: bytes | None = None, probe: bool = True
) -> tuple[OpenAILink, Server]:
    """A link started on a scripted server, returned once its endpoint is up (after its probe)."""
    endpoint = Endpoint("e", EndpointLimits(concurrency=concurrency), time.monotonic())
    server = Server(slots, endpoint, answer)
    scripted = await ScriptedServer(server.respond).start()
    link = OpenAILink(OpenAITarget(scripted.base_url, "m", probe=probe), endpoint)
    task = asyncio.create_task(link.maintain(HealthPolicy(0.05, 1.0, 5.0)))
    try:
        async with asyncio.timeout(5):
            while not endpoint.up:
                await asyncio.sleep(0.005)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await scripted.close()
    return link, server


def test_a_server_that_runs_one_at_a_time_is_probed_before_traffic_its_queue_seen() -> None:
    """Concurrency 2 at a serial server: a lone probe, then two at once, the second waiting for
    the first: the pace is its step, and the batch is 1."""
    link, server = asyncio.run(probed_link(slots=1, concurrency=2))
    probed = link.endpoint.probed
    assert probed is not None and probed.step_s is not None
    assert STEP_S * 0.8 <= probed.step_s <= STEP_S * 3
    assert probed.first_token_s is not None and probed.first_token_s >= STEP_S * 0.8
    assert probed.batch == 1
    assert link.probes == {"ok": 1, "failed": 0, "timeout": 0}
    assert len(server.completions) == 3  # the lone one and a round of its concurrency
    assert all(body["max_tokens"] == PROBE_TOKENS and body["stream"] is True for body, _ in server.completions)
    assert not any(up for _, up in server.completions)  # all before the endpoint took traffic
    described = link.describe()["probe"]
    assert described["outcome"] == "ok" and described["batch"] == 1 and described["step_ms"] > 0


def test_a_server_that_runs_them_together_shows_no_queue() -> None:
    link, server = asyncio.run(probed_link(slots=4, concurrency=0))
    probed = link.endpoint.probed
    assert probed is not None and probed.batch == 0  # none waited: how many it runs is not known
    assert len(server.completions) == 1 + endpoint_probe.MAX_PROBES  # no concurrency cap: at most MAX_PROBES


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (plain_response("500 Internal Server Error", b"boom"), "answered 500"),
        (HEAD + _chunk(b'{"error": "no"}'), "upstream error"),
        (HEAD + _chunk(b"not json"), "not JSON"),
        (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 0\r\n\r\n", "no token"),
    ],
)
def test_a_server_that_fails_its_probe_is_up_all_the_same_the_failure_counted(answer: bytes, why: str) -> None:
    link, _ = asyncio.run(probed_link(slots=1, concurrency=1, answer=answer))
    assert link.endpoint.up and link.endpoint.probed is None
    assert link.probes["failed"] == 1
    assert link.last_probe is not None and why in link.last_probe.why


def test_a_probe_that_hangs_is_abandoned_and_the_endpoint_takes_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_probe, "PROBE_TIMEOUT_S", 0.2)
    started = time.monotonic()
    link, _ = asyncio.run(probed_link(slots=1, concurrency=1, answer=b""))
    assert time.monotonic() - started < 2.0
    assert link.endpoint.up and link.probes["timeout"] == 1 and link.endpoint.probed is None


def test_probe_off_sends_nothing() -> None:
    link, server = asyncio.run(probed_link(slots=1, concurrency=1, probe=False))
    assert server.completions == [] and link.last_probe is None and link.endpoint.probed is None


# -- the reading, on a clock the test sets ---------------------------------------------------------


def _stream(sent: float, tokens: list[float]) -> ProbeStream:
    """A probe sent at `sent` whose tokens came at `tokens` (each in a read of its own)."""
    at = [sent]
    stream = ProbeStream(lambda: at[0])
    stream.response_head(200, {})
    for t in tokens:
        at[0] = t
        stream.response_body(b'data: {"choices":[{"text":"x"}]}\n\n')
    return stream


Timed = tuple[float, list[float]]


def _read(*round_: Timed, lone: Timed | None = None) -> Probed | None:
    async def made() -> Probed | None:
        return read_probes(None if lone is None else _stream(*lone), [_stream(*timed) for timed in round_])

    return asyncio.run(made())


def _measured(*round_: Timed, lone: Timed | None = None) -> Probed:
    probed = _read(*round_, lone=lone)
    assert probed is not None
    return probed


def test_the_reading_takes_the_median_pace_the_least_first_token_and_a_queue_only_when_one_waited() -> None:
    # two streams at once, 10 and 30 ms a token, neither waiting: no batch
    probed = _measured((0.0, [0.05, 0.06, 0.07]), (0.0, [0.05, 0.08, 0.11]))
    assert probed.step_s == pytest.approx(0.02) and probed.first_token_s == pytest.approx(0.05)
    assert probed.batch == 0
    # three sent at once, two streaming together, the third starting after one of them ended: 2
    assert _measured((0.0, [0.01, 0.02, 0.03]), (0.0, [0.01, 0.02, 0.03]), (0.0, [0.04, 0.05, 0.06])).batch == 2
    # tokens that came in one read tell no pace; the first token still counts
    probed = _measured((0.0, [0.05, 0.05]))
    assert probed.step_s is None and probed.first_token_s == pytest.approx(0.05)
    # nothing streamed in the round: the lone probe's reading; nothing at all: None
    assert _measured((0.0, []), lone=(0.0, [0.2, 0.25])).step_s == pytest.approx(0.05)
    assert _read((0.0, [])) is None


def test_a_pace_is_spread_over_the_tokens_the_chunks_carried() -> None:
    """A server that sends several tokens a chunk (`transformers serve` sends words): its usage,
    else a finish for length (all of `PROBE_TOKENS`), says how many; the time between two tokens
    is the chunks' span over them, as `max_tokens` counts tokens. A server that says nothing is
    taken at a token a chunk."""

    async def made(tail: bytes) -> Probed | None:
        stream = _stream(0.0, [0.05, 0.1, 0.15, 0.2])  # 4 chunks over 0.15 s
        stream.response_body(tail)
        return read_probes(None, [stream])

    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":16}}\n\n'
    length = b'data: {"choices":[{"text":"","finish_reason":"length"}]}\n\n'
    for tail, tokens in ((usage, 16), (length, PROBE_TOKENS), (b"data: [DONE]\n\n", 4)):
        probed = asyncio.run(made(tail))
        assert probed is not None and probed.step_s == pytest.approx(0.15 / (tokens - 1))


def test_a_probe_asks_for_usage_as_an_admitted_request_does() -> None:
    body = orjson.loads(endpoint_probe.probe_body(OpenAITarget("http://127.0.0.1:1/v1", "m")))
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == PROBE_TOKENS
