"""A link to an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, TGI, `transformers serve`).

Each admitted request becomes one streaming `POST {base}/completions` on a pooled httpx client
(openai_stream.py maps the fields); each chunk with text is counted by the lifecycle and relayed to
the request's owner as text, the end finishes it with the server's usage counts. What the server
answers maps onto the lifecycle's endings (lifecycle.py), as a worker link's replies do:

- 429 or 503: the endpoint is full. It is paused for its Retry-After (admission routes around it,
  admission/pool.py) and the request is re-routed once or answered with a yield (`endpoint_busy`).
- A connection that cannot be made or breaks: the endpoint is lost, as when a worker link drops:
  down until a health check passes, its request re-routed once before the first token, else
  `worker_lost`.
- Another 4xx: the server refused the request itself (`bad_frame`, with its message); another
  5xx or a malformed stream: `internal`.
- A cancel (client gone, deadline, drain) cancels the request's task, which closes its stream:
  the server sees the disconnect and stops generating.

Health: `GET /health` at the server's root (vLLM, SGLang, TGI, llama.cpp and transformers serve
all have it), or `GET {base}/models` where that is 404, every ping interval; up at the first
success, down after a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from httpx_sse import EventSource, SSEError

from governor.admission.endpoint import Endpoint, OpenAITarget
from governor.admission.limits import hint_of
from governor.lifecycle import InflightRequest, Lifecycle
from governor.links.health import HealthPolicy
from governor.links.openai_stream import UpstreamProtocolError, completion_body, read_chunk, retry_after_s
from govwire.auth import SharedSecret
from govwire.errors import BadFrame, GovernorError, InternalError
from govwire.messages import Completion
from govwire.request import GenerateRequest
from govwire.vocab import FinishReason

log = logging.getLogger("governor.openai_link")

DEFAULT_BUSY_S = 1.0  # the pause after a 429/503 that names no Retry-After
ERROR_PREVIEW_BYTES = 512  # of an error response's body, quoted in the client's error
T = TypeVar("T")


class OpenAILink:
    kind = "openai"
    lifecycle: Lifecycle  # where its requests' answers go (Upstream.bind)

    def __init__(
        self, target: OpenAITarget, endpoint: Endpoint, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.target = target
        self._transport = transport  # httpx's own (TCP) unless a test passes a mock
        self.address = str(target)
        self.endpoint = endpoint
        self.inflight: dict[str, InflightRequest] = {}  # uid -> request
        self.pid: int | None = None  # never spawned by the governor
        self.kill_worker = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._client: httpx.AsyncClient | None = None
        self._health_url = target.root + "/health"  # or {base}/models, where /health is 404
        self.busy_total = 0  # 429/503 answers
        self.last_error = ""  # why the last health check or request failed, for `stats`

    def describe(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "kind": self.kind,
            "model": self.target.model,
            **self.endpoint.describe(),
            "busy": self.busy_total,
            "last_error": self.last_error,
            "pid": None,
            "engine": {},
        }

    def _http(self, health_timeout_s: float, stall_timeout_s: float) -> httpx.AsyncClient:
        key_file = self.target.api_key_file
        headers = {"authorization": f"Bearer {SharedSecret.read(key_file).token.decode()}"} if key_file else {}
        return httpx.AsyncClient(
            # The governor's caps bound the connections; the pool must never queue a request.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            # read: the longest silence of a stream (the stall timeout); connect: the ping timeout.
            timeout=httpx.Timeout(stall_timeout_s, connect=health_timeout_s, pool=None),
            headers=headers,
            transport=self._transport,
            trust_env=False,  # never route loopback traffic through a proxy from the environment
        )

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, uid: str, request: InflightRequest, generate: GenerateRequest) -> None:
        path, body = completion_body(generate, self.target.model)  # BadFrame for fields it cannot take
        if self._client is None:
            raise BadFrame("endpoint not started", generate.id)  # only before `maintain` runs
        self.inflight[uid] = request
        task = asyncio.get_running_loop().create_task(self._stream(uid, request, path, body))
        task.add_done_callback(lambda _: self._ended(uid, request))
        self._tasks[uid] = task

    def _ended(self, uid: str, request: InflightRequest) -> None:
        """The request's task is over. A task cancelled before its first step never ran `_stream`
        (not even its handlers): answered here, as cancelled, with nothing generated."""
        self._tasks.pop(uid, None)
        if self._current(uid, request):
            self._finish(uid, request, [], FinishReason.CANCELLED, None)

    def cancel(self, uid: str) -> None:
        task = self._tasks.get(uid)
        if task is not None:
            task.cancel()

    def _current(self, uid: str, request: InflightRequest) -> bool:
        """Still ours to answer (not settled by a deadline, a disconnect or a re-route since)."""
        return self.inflight.get(uid) is request

    async def _stream(self, uid: str, request: InflightRequest, path: str, body: dict[str, Any]) -> None:
        assert self._client is not None
        owner = request.owner
        parts: list[str] = []
        finish: FinishReason | None = None
        usage = None
        try:
            async with self._client.stream("POST", self.target.base_url + path, json=body) as response:
                status = response.status_code
                if status in (429, 503):
                    self._busy(uid, request, response.headers)
                    return
                if status != 200:
                    preview = (await self._preview(response)).decode("utf-8", "replace")
                    self.last_error = f"HTTP {status}"
                    cls = BadFrame if 400 <= status < 500 else InternalError
                    message = f"endpoint {self.address} answered {status}: {preview}"
                    self._fail(uid, request, cls(message, request.client_id))
                    return
                ended = False  # by [DONE] or a finish_reason: a stream cut before either was lost
                async for event in EventSource(response).aiter_sse():
                    if event.data == "[DONE]":
                        ended = True
                        break
                    if not event.data:
                        continue
                    chunk = read_chunk(event.data)
                    ended = ended or chunk.finish_reason is not None
                    finish = chunk.finish_reason or finish
                    usage = chunk.usage or usage
                    if chunk.text:
                        if not self._current(uid, request):
                            return
                        parts.append(chunk.text)
                        self.lifecycle.token(request)
                        owner.send_text(request, chunk.text)
                        owner.flush()
                if not ended:
                    raise httpx.RemoteProtocolError("the stream ended without [DONE] or a finish_reason")
        except asyncio.CancelledError:  # our cancel: the stream is closed, the server stops
            self._finish(uid, request, parts, FinishReason.CANCELLED, usage)
            return
        except SSEError as exc:  # (a TransportError) a 200 that is not an event stream
            self._protocol_error(uid, request, str(exc))
            return
        except httpx.TransportError as exc:
            self._lost(uid, request, exc)
            return
        except UpstreamProtocolError as exc:
            self._protocol_error(uid, request, str(exc))
            return
        except Exception:  # a bug of ours: this request fails, never silently and never the others
            log.exception("event=internal_error where=openai_link endpoint=%s", self.address)
            self._fail(uid, request, InternalError("internal error relaying the endpoint's answer", request.client_id))
            return
        self._finish(uid, request, parts, finish or FinishReason.EOS, usage)

    @staticmethod
    async def _preview(response: httpx.Response) -> bytes:
        """The start of an error response's body, read no further."""
        head = b""
        async for data in response.aiter_bytes():
            head += data
            if len(head) >= ERROR_PREVIEW_BYTES:
                break
        return head[:ERROR_PREVIEW_BYTES]

    def _protocol_error(self, uid: str, request: InflightRequest, why: str) -> None:
        self.last_error = why
        log.warning("event=upstream_protocol_error endpoint=%s error=%r", self.address, why)
        self._fail(uid, request, InternalError(f"endpoint {self.address}: {why}", request.client_id))

    def _fail(self, uid: str, request: InflightRequest, error: GovernorError) -> None:
        self._end(uid, request, self.lifecycle.fail, error)

    def _end(self, uid: str, request: InflightRequest, ending: Callable[[InflightRequest, T], None], arg: T) -> None:
        """End a request through the lifecycle's `ending` (finish, fail, busy, lose), if it is
        still ours: not settled by a deadline, a disconnect or a re-route since. Then flush its
        owner (this runs in the request's own task, outside any read)."""
        if self._current(uid, request):
            ending(request, arg)
            request.owner.flush()

    def _finish(self, uid: str, request: InflightRequest, parts: list[str], finish: FinishReason, usage: Any) -> None:
        # Without usage (a server that ignores stream_options) the counts are estimates: the
        # prompt as admission estimated it, and one token per chunk with text.
        prompt_tokens = usage.prompt_tokens if usage is not None else request.grant.ask.prompt_tokens
        completion_tokens = usage.completion_tokens if usage is not None else len(parts)
        cached = usage.cached_tokens if usage is not None else 0
        completion = Completion(
            "".join(parts), prompt_tokens, completion_tokens, finish, 0.0, cached_prompt_tokens=cached
        )
        self._end(uid, request, self.lifecycle.finish, completion)

    def _busy(self, uid: str, request: InflightRequest, headers: httpx.Headers) -> None:
        wait_s = retry_after_s(dict(headers.items()))
        wait_s = DEFAULT_BUSY_S if wait_s is None else wait_s
        now = time.monotonic()
        self.endpoint.paused_until = max(self.endpoint.paused_until, now + wait_s)
        self.busy_total += 1
        log.info("event=endpoint_busy endpoint=%s retry_after_s=%.3f", self.address, wait_s)
        self._end(uid, request, self.lifecycle.busy, hint_of(wait_s))

    def _lost(self, uid: str, request: InflightRequest, exc: httpx.TransportError) -> None:
        """The connection failed: the endpoint goes down until a health check passes, and the request
        is re-routed once (before its first token) or fails with `worker_lost`."""
        why = f"{type(exc).__name__}: {exc}"
        self.last_error = why
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            log.error("event=worker_unresponsive worker=%s why=%r", self.address, why)
        if self.endpoint.up and not isinstance(exc, httpx.TimeoutException):
            # The server is gone (refused, reset, cut mid-stream): down until a health check
            # passes. One stream's silence is that request's loss, not the endpoint's.
            self.endpoint.up = False
            log.warning("event=worker_lost worker=%s why=%r", self.address, why)
        self._end(uid, request, self.lifecycle.lose, f"connection to endpoint {self.address} lost ({why})")

    # -- health -----------------------------------------------------------------------------------

    async def maintain(self, health: HealthPolicy) -> None:
        """Check the server every ping interval; up while it answers."""
        self._client = self._http(health.ping_timeout_s, health.stall_timeout_s)
        try:
            await self._watch(health)
        finally:
            client, self._client = self._client, None
            await client.aclose()

    async def _watch(self, health: HealthPolicy) -> None:
        failures_logged = 0
        while True:
            error = await self._check(health.ping_timeout_s)
            if error is None:
                failures_logged = 0
                if not self.endpoint.up:
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
        assert self._client is not None
        try:
            response = await self._client.get(self._health_url, timeout=timeout_s)
            models_url = self.target.base_url + "/models"
            if response.status_code == 404 and self._health_url != models_url:
                self._health_url = models_url
                return await self._check(timeout_s)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # never let one odd answer stop the health checks for good
            log.exception("event=internal_error where=health_check endpoint=%s", self.address)
            return f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return f"health check answered {response.status_code}"
        return None

    def close(self) -> None:
        """Cancel what is in flight (each answers `cancelled`); the client closes with `maintain`."""
        for task in list(self._tasks.values()):
            task.cancel()
