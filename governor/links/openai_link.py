"""A link to an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, TGI, `transformers serve`).

Each admitted request becomes one streaming `POST {base}/completions` (or `/chat/completions`) on
a pooled keep-alive connection (http_client.py; openai_stream.py maps the fields). Its response
goes to the request's relay (openai_relay.py), which reads the body as server-sent events (sse.py)
straight from the parser's callbacks and tells the link how it ended: each chunk with text is
counted by the lifecycle and handed to the request's owner with its event's bytes (the HTTP front
door relays them as they came, the NDJSON door renders the text), and the owner is flushed once
per read, however many chunks it brought. The end finishes the request with the server's usage.
What the server answers maps onto the lifecycle's endings (lifecycle.py), as a worker link's
replies do:

- 429 or 503: the endpoint is full. It is paused for its Retry-After (admission routes around it,
  admission/pool.py) and the request is re-routed once or answered with a yield (`endpoint_busy`).
- A connection that cannot be made or breaks, or bytes that are not HTTP: the endpoint is lost,
  as when a worker link drops: down until a health check passes, its request re-routed once
  before the first token, else `worker_lost`. A connect timeout or a stream silent for the stall
  timeout loses that request only.
- Another 4xx: the server refused the request itself (`bad_frame`, with its message); another
  5xx or a malformed stream: `internal`.
- A cancel (client gone, deadline, drain) closes the request's connection: the server sees the
  disconnect and stops generating; the request is answered `cancelled` on the next loop turn.

Health: `GET /health` at the server's root (vLLM, SGLang, TGI, llama.cpp and transformers serve
all have it), or `GET {base}/models` where that is 404, every ping interval; up at the first
success (once probed: endpoint_probe.py, unless `probe=off`), down after a failure.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from governor.admission.endpoint import Endpoint, OpenAITarget
from governor.admission.limits import hint_of
from governor.lifecycle import InflightRequest, Lifecycle
from governor.links.endpoint_probe import (
    MAX_PROBES,
    OUTCOMES,
    ProbeOutcome,
    probe,
    probe_body,
)
from governor.links.health import HealthPolicy
from governor.links.http_client import (
    ConnectTimeout,
    HttpClientError,
    HttpPool,
    ResponseHandler,
    StallTimeout,
    request_head,
)
from governor.links.openai_relay import Relay
from governor.links.openai_stream import Usage, completion_body, retry_after_s
from govwire.auth import SharedSecret
from govwire.errors import BadFrame, GovernorError, InternalError
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason

log = logging.getLogger("governor.openai_link")

DEFAULT_BUSY_S = 1.0  # the pause after a 429/503 that names no Retry-After


class OpenAILink:
    kind = "openai"
    lifecycle: Lifecycle  # where its requests' answers go (Upstream.bind)

    def __init__(self, target: OpenAITarget, endpoint: Endpoint, clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.address = str(target)
        self.endpoint = endpoint
        self._clock = clock  # the governor's, which admission reads too: an endpoint's pause ends on it
        url = urlsplit(target.base_url)
        self._tls = url.scheme == "https"
        self._host = url.hostname or ""
        self._port = url.port or (443 if self._tls else 80)
        self._host_header = url.netloc.rpartition("@")[2].encode("idna")
        self._base_path = url.path.rstrip("/").encode()
        self.inflight: dict[str, InflightRequest] = {}  # uid -> request
        self.pid: int | None = None  # never spawned by the governor
        self.kill_worker = None
        self._relays: dict[str, Relay] = {}
        self._pool: HttpPool | None = None  # made by `maintain`, with the health policy's timeouts
        self._headers = b""  # the request headers every request carries (the API key's, if any)
        self._health_path = b"/health"  # or {base}/models, where /health is 404
        self.busy_total = 0  # 429/503 answers
        self.probes = dict.fromkeys(OUTCOMES, 0)  # its probes, by outcome
        self.last_probe: ProbeOutcome | None = None
        self.last_error = ""  # why the last health check or request failed, for `stats`

    @property
    def down_reason(self) -> str:
        """Why it is not up (or why its last request failed)."""
        return self.last_error

    def describe(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "kind": self.kind,
            "model": self.target.model,
            **self.endpoint.describe(),
            "busy": self.busy_total,
            "last_error": self.down_reason,
            "probe": self._describe_probe(),
            "pid": None,
            "engine": {},
        }

    def _describe_probe(self) -> dict[str, Any] | None:
        """Its last probe in `stats`: the outcome and what it measured (ms); None before one."""
        last = self.last_probe
        if last is None:
            return None
        measured = last.measured

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        return {
            "outcome": last.outcome,
            "step_ms": ms(measured.step_s) if measured else None,
            "first_token_ms": ms(measured.first_token_s) if measured else None,
            "batch": measured.batch if measured else 0,
            "why": last.why,
        }

    def _open(self, health: HealthPolicy) -> HttpPool:
        key_file = self.target.api_key_file
        self._headers = b"authorization: Bearer %s\r\n" % SharedSecret.read(key_file).token if key_file else b""
        self._health_path = b"/health"
        # connect: the ping timeout; a stream silent for the stall timeout is lost.
        return HttpPool(
            self._host,
            self._port,
            health.ping_timeout_s,
            health.stall_timeout_s,
            ssl.create_default_context() if self._tls else None,
        )

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, uid: str, request: InflightRequest, generate: GenerateRequest) -> None:
        path, body = completion_body(generate, self.target)  # BadFrame for fields it cannot take
        pool = self._pool
        if pool is None:
            raise BadFrame("endpoint not started", generate.id)  # only before `maintain` runs
        exchange = self._streamed_post(path.encode(), orjson.dumps(body))
        self.inflight[uid] = request
        relay = self._relays[uid] = Relay(self, self.lifecycle, uid, request)
        relay.call = pool.start(exchange, relay)

    def _streamed_post(self, path: bytes, payload: bytes) -> bytes:
        """A JSON `POST {base}{path}` that asks for an event stream, head and body, with the
        headers every request carries (the API key's)."""
        head = request_head(
            b"POST",
            self._base_path + path,
            self._host_header,
            b"content-type: application/json\r\naccept: text/event-stream\r\n" + self._headers,
            len(payload),
        )
        return head + payload

    def cancel(self, uid: str) -> None:
        relay = self._relays.get(uid)
        if relay is not None:
            relay.cancel()

    # -- what its relays tell it (openai_relay.RelayLink) -----------------------------------------

    def holds(self, uid: str, request: InflightRequest) -> bool:
        """Still ours to answer (not settled by a deadline, a disconnect or a re-route since)."""
        return self.inflight.get(uid) is request

    def drop_relay(self, uid: str) -> None:
        """Its relay has nothing more to do."""
        self._relays.pop(uid, None)

    def _ours_to_end(self, uid: str, request: InflightRequest) -> bool:
        """Whether an ending of `request` is still the link's to tell the lifecycle (it `holds` it);
        its relay is done either way. The ending then flushes the request's owner (it runs in a
        read of the upstream's connection, or a timer: never a client's read)."""
        self.drop_relay(uid)
        return self.holds(uid, request)

    def _fail(self, uid: str, request: InflightRequest, error: GovernorError) -> None:
        if self._ours_to_end(uid, request):
            self.lifecycle.fail(request, error)
            request.owner.flush()

    def finish(
        self, uid: str, request: InflightRequest, parts: list[str], finish: FinishReason, usage: Usage | None
    ) -> None:
        # Without usage (a server that ignores stream_options) the counts are estimates: the
        # prompt as admission estimated it, and one token per chunk with text.
        prompt_tokens = usage.prompt_tokens if usage is not None else request.grant.ask.prompt_tokens
        completion_tokens = usage.completion_tokens if usage is not None else len(parts)
        cached = usage.cached_tokens if usage is not None else 0
        completion = Completion(
            "".join(parts), prompt_tokens, completion_tokens, finish, 0.0, cached_prompt_tokens=cached
        )
        if self._ours_to_end(uid, request):
            self.lifecycle.finish(request, completion)
            request.owner.flush()

    def refused(self, uid: str, request: InflightRequest, status: int, preview: str) -> None:
        """A status other than 200, 429 and 503: the server's own words go to the client."""
        self.last_error = f"HTTP {status}"
        cls = BadFrame if 400 <= status < 500 else InternalError
        self._fail(uid, request, cls(f"endpoint {self.address} answered {status}: {preview}", request.client_id))

    def protocol_error(self, uid: str, request: InflightRequest, why: str) -> None:
        self.last_error = why
        log.warning("event=upstream_protocol_error endpoint=%s error=%r", self.address, why)
        self._fail(uid, request, InternalError(f"endpoint {self.address}: {why}", request.client_id))

    def busy(self, uid: str, request: InflightRequest, headers: dict[bytes, bytes]) -> None:
        wait_s = retry_after_s({k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()})
        wait_s = DEFAULT_BUSY_S if wait_s is None else wait_s
        now = self._clock()
        self.endpoint.paused_until = max(self.endpoint.paused_until, now + wait_s)
        self.busy_total += 1
        log.info("event=endpoint_busy endpoint=%s retry_after_s=%.3f", self.address, wait_s)
        if self._ours_to_end(uid, request):
            self.lifecycle.busy(request, hint_of(wait_s))
            request.owner.flush()

    def lost(self, uid: str, request: InflightRequest, error: HttpClientError) -> None:
        """The exchange failed: the endpoint goes down until a health check passes (unless the
        failure was one stream's silence or a slow connect), and the request is re-routed once
        (before its first token) or fails with `worker_lost`."""
        why = f"{type(error).__name__}: {error}"
        self.last_error = why
        timed_out = isinstance(error, StallTimeout | ConnectTimeout)
        if isinstance(error, StallTimeout):
            log.error("event=worker_unresponsive worker=%s why=%r", self.address, why)
        if self.endpoint.up and not timed_out:
            # The server is gone (refused, reset, cut mid-stream): down until a health check
            # passes. One stream's silence is that request's loss, not the endpoint's.
            self.endpoint.up = False
            log.warning("event=worker_lost worker=%s why=%r", self.address, why)
        if self._ours_to_end(uid, request):
            self.lifecycle.lose(request, f"connection to endpoint {self.address} lost ({why})")
            request.owner.flush()

    # -- health -----------------------------------------------------------------------------------

    async def maintain(self, health: HealthPolicy) -> None:
        """Check the server every ping interval; up while it answers."""
        self._pool = self._open(health)
        try:
            await self._watch(health)
        finally:
            pool, self._pool = self._pool, None
            pool.close()

    async def _probe_before_traffic(self) -> None:
        """It came up: probe it before it takes traffic (endpoint_probe.py: bounded, and whatever
        the outcome, the endpoint is up after it), unless `probe=off`."""
        if not self.target.probe:
            return
        result = await probe(self._send_probe, self.endpoint.limits.concurrency or MAX_PROBES, self._clock)
        self.probes[result.outcome] += 1
        self.last_probe = result
        measured = result.measured
        if measured is None:
            why = result.why
            log.warning("event=endpoint_probe_failed worker=%s outcome=%s why=%r", self.address, result.outcome, why)
            return
        self.endpoint.probed = measured
        log.info(
            "event=endpoint_probed worker=%s outcome=%s step_ms=%s first_token_ms=%.1f batch=%d",
            self.address,
            result.outcome,
            "none" if measured.step_s is None else f"{measured.step_s * 1000:.2f}",
            (measured.first_token_s or 0.0) * 1000,
            measured.batch,
        )

    def _send_probe(self, handler: ResponseHandler) -> Callable[[], None]:
        """One probe request (endpoint_probe.Send): a short streamed completion on the pool."""
        assert self._pool is not None
        return self._pool.start(self._streamed_post(b"/completions", probe_body(self.target)), handler).abort

    async def _watch(self, health: HealthPolicy) -> None:
        failures_logged = 0
        while True:
            error = await self._check(health.ping_timeout_s)
            if error is None:
                failures_logged = 0
                if not self.endpoint.up:
                    await self._probe_before_traffic()
                    self.endpoint.up = True
                    self.last_error = ""
                    log.info("event=worker_up worker=%s", self.address)
            else:
                self.last_error = error
                if self.endpoint.up:
                    self.endpoint.up = False
                    log.warning("event=worker_down worker=%s why=%r", self.address, error)
                elif failures_logged < 1 or failures_logged % 60 == 0:
                    log.warning("event=worker_unreachable worker=%s why=%r", self.address, error)
                failures_logged += 1
            await asyncio.sleep(health.ping_interval_s)

    async def _check(self, timeout_s: float) -> str | None:
        """None when healthy, else why not."""
        status = await self._get(self._health_path, timeout_s)
        models = self._base_path + b"/models"
        if status == 404 and self._health_path != models:
            self._health_path = models
            status = await self._get(models, timeout_s)
        if isinstance(status, str):
            return status
        return None if status == 200 else f"health check answered {status}"

    async def _get(self, path: bytes, timeout_s: float) -> int | str:
        """The status of a `GET`, or why there is none."""
        assert self._pool is not None
        probe = _Probe()
        call = self._pool.start(request_head(b"GET", path, self._host_header, self._headers, None), probe, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                return await probe.answer
        except TimeoutError:
            call.abort()
            return f"StallTimeout: no answer within {timeout_s:g} s"

    def close(self) -> None:
        """Cancel what is in flight (each answers `cancelled`); the pool closes with `maintain`."""
        for relay in list(self._relays.values()):
            relay.cancel()


class _Probe:
    """A health check's response: its status once it ended, its body dropped."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[int | str] = asyncio.get_running_loop().create_future()
        self._status = 0

    def response_head(self, status: int, headers: dict[bytes, bytes]) -> None:
        self._status = status

    def response_body(self, data: bytes) -> None:
        pass

    def response_end(self) -> None:
        if not self.answer.done():
            self.answer.set_result(self._status)

    def response_failed(self, error: HttpClientError) -> None:
        if not self.answer.done():
            self.answer.set_result(f"{type(error).__name__}: {error}")

    def read_done(self) -> None:
        pass
