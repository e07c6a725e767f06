"""Probing an OpenAI-compatible endpoint as it comes up, so that a cold governor's first promises
are true ones.

Before any of its streams ended, the release forecast knows nothing of an OpenAI-compatible
server's speed (a worker process reports its own step time; a server of someone else's does not):
it would assume `release_forecast.PRIOR_STEP_S` a token, and the appointments made from that bind,
so the server idles between sleeping clients. So each time the link sees the endpoint come up (at
start, and again after it was down: a restarted server may be another model or machine), it
streams a few short completions and measures:

- **first**, one probe alone: it also warms the server (a lazy model load, a cold cache), so
  its times are read only when the round below gives none;
- **then** a round of `count` probes at once (the endpoint's `concurrency`, at most
  `MAX_PROBES`): the time from sending to the first token (the least of the round: a prefill
  at that load), the time between two tokens (the median of each stream's own pace, spread over
  the tokens its chunks carried: a server may send several tokens in one chunk, as `transformers
  serve` sends words, and `max_tokens` counts tokens), and, when some
  of them waited for their first token until another had ended while the others streamed, how
  many the server runs at once (`Probed.batch`: the forecast models the rest as its queue).

What it costs the endpoint: (1 + count) × `PROBE_TOKENS` tokens of a `PROBE_PROMPT`-long prompt,
each time it comes up, before it takes traffic (so a probe never runs beside clients' requests,
and the endpoint's `concurrency` holds at the server). It is bounded: not done within
`PROBE_TIMEOUT_S`, it is abandoned (what its streams measured by then is kept) and the endpoint
takes traffic all the same; a server that fails it (an error, no stream) is not held back either.
Each outcome is counted (`governor_endpoint_probes_total`) and logged once. An operator's
`step_ms=` and `batch=` still win over what a probe measured; `probe=off` skips it (a server whose
every request is billed).

The reading (`read_probes`) is pure; `ProbeStream` is one probe's response handler, timed on the
governor's clock.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from governor.admission.endpoint import OpenAITarget, Probed
from governor.admission.release_forecast import stream_pace
from governor.links.http_client import HttpClientError, ResponseHandler
from governor.links.openai_stream import UpstreamProtocolError, read_chunk
from governor.links.sse import SseDecoder, SseError
from govwire.vocab import FinishReason

PROBE_TOKENS = 16
"""Tokens each probe asks for: enough for a pace (fifteen gaps: with eight, one slow step moved a
serial server's pace threefold from one start to the next), few enough to cost the server little."""

PROBE_PROMPT = "The governor measures how fast this endpoint streams."
"""A short prompt: its prefill is near the least a request pays."""

MAX_PROBES = 4
"""The most probes sent at once: enough to see a server that runs one or two at a time queue the rest."""

PROBE_TIMEOUT_S = 3.0
"""A probe not done by then is abandoned (its connections closed; outcome `timeout`) and its
endpoint takes traffic: the longest a probe delays an endpoint that came up. Enough for both rounds
of a server at 100 ms a token; a slower one is measured by what streamed by then."""

OUTCOMES = ("ok", "failed", "timeout")
"""A probe's outcomes: measured something, measured nothing (an error, no stream), or abandoned."""

_DONE = b"[DONE]"


def probe_body(target: OpenAITarget) -> bytes:
    """A probe's request body: a short greedy streamed completion with the fields an admitted
    request's has (`ignore_eos` is not one: `transformers serve` answers 422; an end of sequence
    within `PROBE_TOKENS` leaves fewer gaps to time, not none), usage asked for: how many tokens
    its chunks carried."""
    return orjson.dumps(
        {
            "model": target.model,
            "prompt": PROBE_PROMPT,
            "max_tokens": PROBE_TOKENS,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


class ProbeStream:
    """One probe's response (http_client.ResponseHandler): when it was sent, when its first and
    last tokens came (a chunk with text is a token: read as a request's stream is,
    limits.Progress), how many tokens those chunks carried, and why it failed, if it did."""

    __slots__ = (
        "sent_at",
        "t_first_token",
        "t_last_token",
        "tokens_seen",
        "generated",
        "error",
        "ended",
        "_clock",
        "_decoder",
        "_ok",
    )

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.sent_at = clock()
        self.t_first_token: float | None = None
        self.t_last_token = 0.0
        self.tokens_seen = 0
        # Tokens generated, as its usage says (else all of `PROBE_TOKENS` when it finished for
        # length); 0: not said (each chunk is taken for a token).
        self.generated = 0
        self.error = ""
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoder = SseDecoder()
        self._ok = False

    def _end(self, error: str = "") -> None:
        if not self.ended.done():
            self.error = error
            self.ended.set_result(None)

    def response_head(self, status: int, headers: dict[bytes, bytes]) -> None:
        self._ok = status == 200
        if not self._ok:
            self._end(f"answered {status}")

    def response_body(self, data: bytes) -> None:
        if not self._ok or self.ended.done():
            return
        try:
            events = self._decoder.feed(data)
            for event in events:
                if event == _DONE:
                    return self._end()
                chunk = read_chunk(event)
                if chunk.usage is not None:
                    self.generated = chunk.usage.completion_tokens
                elif chunk.finish_reason is FinishReason.LENGTH and not self.generated:
                    self.generated = PROBE_TOKENS
                if chunk.text:
                    now = self._clock()
                    self.tokens_seen += 1
                    self.t_last_token = now
                    if self.t_first_token is None:
                        self.t_first_token = now
        except (UpstreamProtocolError, SseError) as exc:
            self._end(str(exc))

    def response_end(self) -> None:
        self._end()

    def response_failed(self, error: HttpClientError) -> None:
        self._end(f"{type(error).__name__}: {error}")

    def read_done(self) -> None:
        pass


def _most_at_once(streams: list[ProbeStream]) -> int:
    """The most of these streams that were streaming at one moment (first to last token)."""
    edges = sorted(
        edge for s in streams if s.t_first_token is not None for edge in ((s.t_first_token, 1), (s.t_last_token, 0))
    )  # at a tie, an end before a start: a stream that starts as another ends did not overlap it
    most = now = 0
    for _, start in edges:
        now += 1 if start else -1
        most = max(most, now)
    return most


def _queued(streams: list[ProbeStream]) -> bool:
    """Whether a stream's first token came only after another had ended: it waited in the server's queue."""
    ends = [s.t_last_token for s in streams if s.t_first_token is not None]
    if len(ends) < 2:
        return False
    first_end = min(ends)
    return any(s.t_first_token is not None and s.t_first_token >= first_end for s in streams)


def _token_pace(stream: ProbeStream) -> float | None:
    """A probe's time between two tokens: its chunks' pace (`stream_pace`), spread over the tokens
    they carried when the server said more than one a chunk."""
    pace = stream_pace(stream)
    chunks = stream.tokens_seen
    if pace is None or stream.generated <= chunks:
        return pace
    return pace * (chunks - 1) / (stream.generated - 1)


def read_probes(lone: ProbeStream | None, round_: list[ProbeStream]) -> Probed | None:
    """What the probes measured (see the module's docstring); None when no probe streamed a token."""
    for streams in (round_, [lone] if lone is not None else []):
        started = [s for s in streams if s.t_first_token is not None]
        if not started:
            continue
        paces = [pace for s in started if (pace := _token_pace(s)) is not None]
        first_token_s = min(s.t_first_token - s.sent_at for s in started if s.t_first_token is not None)
        batch = 0
        if len(streams) > 1 and _queued(started):
            batch = _most_at_once(started)
        return Probed(statistics.median(paces) if paces else None, first_token_s, batch)
    return None


Send = Callable[[ResponseHandler], Callable[[], None]]
"""Sends one probe request to the endpoint with this handler; returns what aborts it."""


async def _run(send: Send, streams: list[ProbeStream]) -> None:
    """These probes sent at once, each awaited to its end (those not ended aborted if cancelled)."""
    aborts = [send(stream) for stream in streams]
    try:
        await asyncio.gather(*(s.ended for s in streams))
    finally:
        for stream, abort in zip(streams, aborts, strict=True):
            if not stream.ended.done():
                abort()


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """A probe's result: what it measured (None: nothing), its outcome (one of `OUTCOMES`), and
    why it measured nothing, if it did not."""

    measured: Probed | None
    outcome: str
    why: str = ""


async def probe(send: Send, count: int, clock: Callable[[], float]) -> ProbeOutcome:
    """One probe of an endpoint: a lone probe, then `count` at once (at most `MAX_PROBES`), within
    `PROBE_TIMEOUT_S`; a timeout keeps what the streams measured by then."""
    lone = [ProbeStream(clock)]
    round_: list[ProbeStream] = []
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await _run(send, lone)
            round_ = [ProbeStream(clock) for _ in range(max(1, min(count, MAX_PROBES)))]
            await _run(send, round_)
    except TimeoutError:
        measured = read_probes(lone[0], round_)
        return ProbeOutcome(measured, "timeout", f"not done within {PROBE_TIMEOUT_S:g} s")
    measured = read_probes(lone[0], round_)
    if measured is not None:
        return ProbeOutcome(measured, "ok")
    errors = [s.error for s in (*lone, *round_) if s.error]
    return ProbeOutcome(None, "failed", errors[-1] if errors else "no token streamed")
