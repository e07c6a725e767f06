"""The clients of benchmarks/peers/openai_upstream.py: one streaming completion, retried after each
429 on its own connection, as the OpenAI SDKs do (without their limit of two retries), and its
timings. The default is an asyncio protocol per request (pre-built request bytes, responses split by
httptools, SSE lines split by hand), cheap enough that its CPU stays out of the server's way on 2
cores; `one_httpx` is the same with `httpx.AsyncClient`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import httpx
import orjson
from httpx_sse import EventSource

REFUSED_FOR_GOOD = "refused for good (429, x-should-retry: false)"


@dataclass(slots=True)
class Sample:
    """One request of a burst, times in seconds on this process's perf_counter."""

    first_sent: float
    admitted_sent: float | None = None  # the attempt that got its 200
    first_event: float | None = None
    done: float | None = None
    tokens: int = 0
    hints_ms: list[float] = field(default_factory=list)  # the retry-after-ms of each 429
    error: str | None = None

    @property
    def ttft_first(self) -> float | None:
        return None if self.first_event is None or self.error else self.first_event - self.first_sent

    @property
    def ttft_admitted(self) -> float | None:
        if self.first_event is None or self.admitted_sent is None or self.error:
            return None
        return self.first_event - self.admitted_sent

    def event(self, data: bytes, now: float) -> None:
        """One SSE `data:` payload of the admitted attempt."""
        if data == b"[DONE]":
            return
        if self.first_event is None:
            self.first_event = now
        chunk = orjson.loads(data)
        if "error" in chunk:
            self.error = f"error event: {str(chunk['error'])[:200]}"
        usage = chunk.get("usage")
        if usage:
            self.tokens = int(usage["completion_tokens"])


def retry_after_ms(headers: dict[str, str]) -> float:
    """The wait a 429 asks for: `retry-after-ms` first (as the OpenAI SDKs read it), else `retry-after`."""
    value = headers.get("retry-after-ms")
    return float(value) if value is not None else 1000 * float(headers.get("retry-after", "1"))


# -- the default client: one asyncio protocol per request ------------------------------------------


class SseConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time. httptools splits the
    responses; a 200's chunked body is split into lines, and each `data:` line is one event (both
    servers send one-line events)."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""  # a refusal's body, or the SSE line being received
        self.keep_alive = True
        self.closed = False
        self.now = 0.0
        self.completed_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def on_message_begin(self) -> None:
        self.status, self.headers, self.body = 0, {}, b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body += body
        if self.status != 200:
            return
        *lines, self.body = self.body.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                self.sample.event(line[5:].strip(), self.now)

    def on_message_complete(self) -> None:
        self.completed_at = self.now
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("closed before the response ended"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)


async def one_raw(url: str, body: bytes, gate: asyncio.Event, timeout_s: float) -> Sample:
    """One streaming completion on a connection of its own, retried there after each 429."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    request = head.encode() + body
    loop = asyncio.get_running_loop()
    await gate.wait()
    sample = Sample(time.perf_counter())
    conn: SseConnection | None = None
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if conn is None or conn.closed:
                    _, conn = await loop.create_connection(lambda: SseConnection(sample), host, port)
                assert conn.transport is not None
                conn.waiter = loop.create_future()
                sent = time.perf_counter()
                conn.transport.write(request)
                await conn.waiter
                if conn.status == 429 and conn.headers.get("x-should-retry") == "false":
                    sample.error = REFUSED_FOR_GOOD  # as the SDKs obey it
                    return sample
                if conn.status == 429:
                    sample.hints_ms.append(retry_after_ms(conn.headers))
                    if not conn.keep_alive:
                        conn.transport.close()
                        conn = None
                    await asyncio.sleep(sample.hints_ms[-1] / 1000)
                    continue
                if conn.status != 200:
                    sample.error = f"HTTP {conn.status} {conn.body[:300].decode('utf-8', 'replace')}"
                elif sample.first_event is None:
                    sample.error = sample.error or "no event"
                sample.admitted_sent, sample.done = sent, conn.completed_at
                return sample
    except (OSError, TimeoutError, httptools.HttpParserError) as exc:
        sample.error = type(exc).__name__
        return sample
    finally:
        if conn is not None and conn.transport is not None:
            conn.transport.close()


# -- the same with httpx ---------------------------------------------------------------------------


async def one_httpx(client: httpx.AsyncClient, url: str, body: bytes, gate: asyncio.Event) -> Sample:
    """One streaming completion through httpx's pool, retried after each 429."""
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    await gate.wait()
    clock = time.perf_counter
    sample = Sample(clock())
    try:
        while True:
            sent = clock()
            async with client.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code == 429 and response.headers.get("x-should-retry") == "false":
                    await response.aread()
                    sample.error = REFUSED_FOR_GOOD  # as the SDKs obey it
                    return sample
                if response.status_code == 429:
                    await response.aread()
                    sample.hints_ms.append(retry_after_ms(dict(response.headers)))
                    await asyncio.sleep(sample.hints_ms[-1] / 1000)
                    continue
                if response.status_code != 200:
                    preview = (await response.aread())[:300].decode("utf-8", "replace")
                    sample.error = f"HTTP {response.status_code} {preview}"
                    return sample
                sample.admitted_sent = sent
                async for event in EventSource(response).aiter_sse():
                    sample.event(event.data.encode(), clock())
                sample.done = clock()
                if sample.first_event is None:
                    sample.error = sample.error or "no event"
                return sample
    except httpx.HTTPError as exc:
        sample.error = type(exc).__name__
        return sample
