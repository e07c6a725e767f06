"""One admitted request's streamed response from an OpenAI-compatible server (openai_link.py).

A `Relay` is the request's http_client.ResponseHandler: its body is read as server-sent events
(sse.py) straight from the parser's callbacks, each chunk with text is counted by the lifecycle and
handed to the request's owner with its event's bytes, and the owner is flushed once per read. The
relay tells what the response was (a stream that ended, a full server, a refusal, a malformed
stream, a failed exchange); its link (a `RelayLink`) keeps the endpoint's state and ends the
request in the lifecycle.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from governor.lifecycle import InflightRequest, Lifecycle
from governor.links.http_client import Call, HttpClientError
from governor.links.openai_stream import Chunk, UpstreamProtocolError, Usage, read_chunk
from governor.links.sse import SseDecoder, SseError
from govwire.vocab import FinishReason

ERROR_PREVIEW_BYTES = 512  # of an error response's body, quoted in the client's error
_DONE = b"[DONE]"


class RelayLink(Protocol):
    """What a relay asks of its link (OpenAILink). Each ending is the link's to tell the lifecycle
    only while it holds the request (not settled by a deadline, a disconnect or a re-route since)."""

    def holds(self, uid: str, request: InflightRequest) -> bool:
        """The request is still the link's to answer."""

    def drop_relay(self, uid: str) -> None:
        """The relay has nothing more to do."""

    def finish(
        self, uid: str, request: InflightRequest, parts: list[str], finish: FinishReason, usage: Usage | None
    ) -> None:
        """The stream ended (or was cancelled) with these texts and the server's usage, if it sent any."""

    def busy(self, uid: str, request: InflightRequest, headers: dict[bytes, bytes]) -> None:
        """The server answered 429 or 503 (with these headers): it is full."""

    def refused(self, uid: str, request: InflightRequest, status: int, preview: str) -> None:
        """The server answered another status than 200, 429 and 503, its body beginning `preview`."""

    def protocol_error(self, uid: str, request: InflightRequest, why: str) -> None:
        """A 200 that is not a stream of completion chunks."""

    def lost(self, uid: str, request: InflightRequest, error: HttpClientError) -> None:
        """The exchange failed before the stream ended."""


class Relay:
    """One admitted request's streamed response (an http_client.ResponseHandler): its events
    become tokens and the request's ending. Until its first text, the events without text (a
    chat stream's role chunk) are held: a request re-routed before its first token shows its
    client nothing of the endpoint it left."""

    __slots__ = (
        "_decoder",
        "_ended",
        "_finish",
        "_held",
        "_preview",
        "_status",
        "_usage",
        "_wrote",
        "call",
        "done",
        "lifecycle",
        "link",
        "parts",
        "request",
        "uid",
    )

    def __init__(self, link: RelayLink, lifecycle: Lifecycle, uid: str, request: InflightRequest) -> None:
        self.link, self.lifecycle, self.uid, self.request = link, lifecycle, uid, request
        self.call: Call | None = None
        self.done = False  # answered (or cancelled): nothing more from this response matters
        self.parts: list[str] = []
        self._status = 0
        self._decoder = SseDecoder()
        self._ended = False  # by [DONE] or a finish_reason: a stream cut before either was lost
        self._finish: FinishReason | None = None
        self._usage: Usage | None = None
        self._held: list[tuple[bytes, bool, bool]] = []  # events without text before the first token
        self._preview = b""
        self._wrote = False  # chunks went to the owner in this read: flush it

    def cancel(self) -> None:
        """Close the stream (the server stops) and answer `cancelled` on the next loop turn,
        outside whoever asked (the lifecycle's cancel, a shed connection, the drain)."""
        if self.done:
            return
        self._stop()
        asyncio.get_running_loop().call_soon(
            self.link.finish, self.uid, self.request, self.parts, FinishReason.CANCELLED, self._usage
        )

    def _stop(self) -> None:
        """Done with this response: its connection is closed unless it already ended."""
        self.done = True
        if self.call is not None:
            self.call.abort()

    # -- http_client.ResponseHandler --------------------------------------------------------------

    def response_head(self, status: int, headers: dict[bytes, bytes]) -> None:
        if self.done:
            return
        self._status = status
        link, uid, request = self.link, self.uid, self.request
        if status == 429 or status == 503:
            self.done = True  # its body is read and dropped; the connection is kept
            link.busy(uid, request, headers)
        elif status == 200:
            kind = headers.get(b"content-type", b"")
            if not kind.startswith(b"text/event-stream"):
                self._stop()
                why = f"expected a text/event-stream response, got content-type {kind.decode('latin-1')[:100]!r}"
                link.protocol_error(uid, request, why)

    def response_body(self, data: bytes) -> None:
        if self.done:
            return
        if self._status != 200:
            self._preview += data[: ERROR_PREVIEW_BYTES - len(self._preview)]
            if len(self._preview) >= ERROR_PREVIEW_BYTES:
                self._stop()
                self._refused()
            return
        link, uid, request = self.link, self.uid, self.request
        if not link.holds(uid, request):  # settled meanwhile (deadline, disconnect): stop it
            self._stop()
            link.drop_relay(uid)
            return
        try:
            events = self._decoder.feed(data)
            for event in events:
                if event == _DONE:
                    self._ended = True
                    self.done = True
                    self._answer()
                    return
                self._chunk(read_chunk(event), event)
        except (UpstreamProtocolError, SseError) as exc:
            self._stop()
            link.protocol_error(uid, request, str(exc))

    def _chunk(self, chunk: Chunk, event: bytes) -> None:
        if chunk.finish_reason is not None:
            self._ended = True
            self._finish = chunk.finish_reason
        if chunk.usage is not None:
            self._usage = chunk.usage
        request = self.request
        if chunk.text:
            self.parts.append(chunk.text)
            self.lifecycle.token(request)
            if self._held:
                self._release_held()
            request.owner.relay_event(request, chunk.text, event, chunk.usage is not None, False)
            self._wrote = True
            return
        usage = chunk.usage is not None
        only_usage = usage and chunk.finish_reason is None
        if request.tokens_seen:
            request.owner.relay_event(request, "", event, usage, only_usage)
            self._wrote = True
        else:
            self._held.append((event, usage, only_usage))

    def _release_held(self) -> None:
        request = self.request
        for event, usage, only_usage in self._held:
            request.owner.relay_event(request, "", event, usage, only_usage)
        self._held.clear()

    def _answer(self) -> None:
        """The stream ended well: what was held goes out, then the request finishes."""
        request = self.request
        if self._held and self.link.holds(self.uid, request):
            self._release_held()
        self.link.finish(self.uid, request, self.parts, self._finish or FinishReason.EOS, self._usage)

    def _refused(self) -> None:
        """A status other than 200, 429 and 503: the server's own words go to the client."""
        self.link.refused(self.uid, self.request, self._status, self._preview.decode("utf-8", "replace"))

    def response_end(self) -> None:
        if self.done:
            self.link.drop_relay(self.uid)
            return
        self.done = True
        if self._status != 200:
            self._refused()
        elif self._ended:
            self._answer()
        else:
            self.link.lost(self.uid, self.request, StreamCut("the stream ended without [DONE] or a finish_reason"))

    def response_failed(self, error: HttpClientError) -> None:
        if self.done:
            self.link.drop_relay(self.uid)
            return
        self.done = True
        self.link.lost(self.uid, self.request, error)

    def read_done(self) -> None:
        if self._wrote:
            self._wrote = False
            if not self.done:  # else its ending flushed it
                self.request.owner.flush()


class StreamCut(HttpClientError):
    """A response that ended (by its length or chunking) before its stream did."""
