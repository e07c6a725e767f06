"""The response to one admitted OpenAI request, rendered as the lifecycle decides it: a completion
(or chat.completion) body, or a stream of chunks over `text/event-stream` whose `200` goes out with
the first token, so anything that ends it before that (an upstream's 429, a deadline, a lost
worker) still gets its own status. An OpenAI-compatible endpoint's events are relayed as their
bytes; a worker's tokens become chunks of our own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from governor.doors.gateway import DROPPED, NO_ENDPOINTS
from governor.doors.http_wire import LAST_CHUNK, chunk, response, status_line
from governor.doors.openai_api import (
    DONE_EVENT,
    STATUS_OF_CODE,
    chat_chunk_event,
    chat_response,
    chunk_event,
    completion_response,
    error_body,
    error_event,
    usage_event,
)
from governor.lifecycle import InflightRequest
from govwire.errors import GovernorError
from govwire.messages import Completion
from govwire.vocab import ErrorCode

_SSE = b"text/event-stream"


def error_response(error: GovernorError, keep: bool) -> bytes:
    """An admitted request's error, before any of its response: a 503 because no endpoint is up
    says so in llm-d's words too (`rejected-no-endpoints`)."""
    status = STATUS_OF_CODE.get(error.code, 500)
    extra = [(DROPPED, NO_ENDPOINTS)] if error.code == ErrorCode.WORKER_UNAVAILABLE else None
    return response(status, error_body(status, error), keep, extra)


@dataclass(slots=True)
class Exchange:
    """The admitted request being answered: how its response is written."""

    request: InflightRequest
    model: str
    stream: bool
    usage: bool
    keep_alive: bool
    created: int
    chat: bool = False  # rendered as chat.completion(.chunk)s
    chunked: bool = True  # HTTP/1.1; an HTTP/1.0 stream is sent as it comes and ends with the connection
    headers_sent: bool = False
    relayed: bool = False  # an OpenAI-compatible endpoint's events went out as they came
    usage_sent: bool = False  # one of them carried the usage
    feedback: list[tuple[bytes, bytes]] = field(default_factory=list)  # llm-d's headers on its 200

    def piece(self, data: bytes, last: bool = False) -> bytes:
        """Stream bytes in the response's framing."""
        if not self.chunked:
            return data
        return chunk(data) + LAST_CHUNK if last else chunk(data)

    def head(self) -> bytes:
        """The stream's `200` and, for a chat stream of our own, its role chunk (once)."""
        if self.headers_sent:
            return b""
        self.headers_sent = True
        headers = [(b"content-type", _SSE), (b"cache-control", b"no-cache"), *self.feedback]
        if self.chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        head = status_line(200, headers, self.keep_alive)
        if self.chat and not self.relayed:  # a relayed chat stream has the endpoint's
            role = chat_chunk_event(self.request.client_id, self.model, self.created, "", role=True)
            head += self.piece(role)
        return head

    def token(self, rest: bytes) -> bytes:
        """A worker's token: rendered as a completion (or chat) chunk of our own."""
        text = orjson.loads(b'{"id":0' + rest).get("text", "")
        event = chat_chunk_event if self.chat else chunk_event
        piece = event(self.request.client_id, self.model, self.created, text if type(text) is str else str(text))
        return self.head() + self.piece(piece)

    def relay(self, event: bytes, usage: bool, only_usage: bool) -> bytes:
        """An OpenAI-compatible endpoint's event, relayed as its bytes: the request and the
        endpoint speak the same format (completions or chat, as the request came), so nothing is
        re-encoded (the chunks carry the endpoint's id). A usage chunk goes only to a client that
        asked for usage."""
        if usage:
            if only_usage and not self.usage:
                return b""
            self.usage_sent = True
        self.relayed = True
        return self.head() + self.piece(b"data: " + event + b"\n\n")

    def done(self, completion: Completion) -> bytes:
        """Its end: the last chunks (and the usage, estimated where the endpoint gave none), or
        the whole body."""
        rid, model, created = self.request.client_id, self.model, self.created
        if not self.stream:
            render = chat_response if self.chat else completion_response
            return response(200, render(rid, model, created, completion), self.keep_alive, self.feedback)
        usage = b""
        if self.usage and not self.usage_sent:
            usage = usage_event(rid, model, created, completion, self.chat)
        final = b""  # (a relayed stream's finish chunk went through)
        if not self.relayed:
            event = chat_chunk_event if self.chat else chunk_event
            final = event(rid, model, created, "", completion.finish_reason)
        return self.head() + self.piece(final + usage + DONE_EVENT, last=True)

    def error(self, error: GovernorError) -> bytes:
        """Ended in `error`: its own status before any of the response, else an error event."""
        if self.headers_sent:
            return self.piece(error_event(error) + DONE_EVENT, last=True)
        return error_response(error, self.keep_alive)
