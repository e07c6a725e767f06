"""Test doubles for unit tests (integration tests use the real processes)."""

from __future__ import annotations

import random
from typing import Any

import orjson

from governor.admission import InflightLimiter, RetryHintEstimator, RetryHintPolicy
from governor.auth import SharedSecret
from governor.errors import WorkerUnavailable
from governor.ingress import Ingress
from governor.pool import Endpoint, EndpointLimits, Pool
from governor.state import InflightRequest, ServerState
from governor.validation import OP_CANCEL, GenerateRequest, IntegrityMode, Limits


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeLink:
    def __init__(self) -> None:
        self.address = "fake"
        self.inflight: dict[str, InflightRequest] = {}


class FakeUpstream:
    """Records dispatches and cancels instead of talking to a worker."""

    def __init__(self) -> None:
        self.link = FakeLink()
        self.links: list[Any] = []
        self.available = True
        self.dispatched: dict[str, tuple[InflightRequest, GenerateRequest]] = {}
        self.sent_frames: list[dict[str, Any]] = []
        self._next = 0

    def dispatch(self, request: InflightRequest, generate: GenerateRequest) -> None:
        if not self.available:
            raise WorkerUnavailable("no worker is connected; retry later", request.client_id)
        self._next += 1
        request.uid = str(self._next)
        request.link = self.link  # type: ignore[assignment]
        self.link.inflight[request.uid] = request
        self.dispatched[request.uid] = (request, generate)

    def cancel(self, request: InflightRequest) -> None:
        self.sent_frames.append({"id": request.uid, "op": OP_CANCEL})


class FakeTransportWrites:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        self.chunks.append(data)

    def lines(self) -> list[bytes]:
        return b"".join(self.chunks).splitlines()


def make_state(
    max_inflight: int = 2,
    integrity: IntegrityMode = IntegrityMode.REQUIRED,
    clock: FakeClock | None = None,
    upstream: FakeUpstream | None = None,
    max_new_tokens: int = 64,
    hint_policy: RetryHintPolicy | None = None,
    pool: Pool | None = None,
    auth: SharedSecret | None = None,
) -> ServerState:
    clock = clock or FakeClock()
    endpoint = Endpoint("fake", EndpointLimits(), clock())
    endpoint.up = True
    return ServerState(
        limits=Limits(max_new_tokens=max_new_tokens, integrity=integrity),
        limiter=InflightLimiter(max_inflight),
        pool=pool or Pool([endpoint], 0.0, 0.0, max_inflight, clock()),
        hints=RetryHintEstimator(hint_policy or RetryHintPolicy(), max_inflight, rng=random.Random(7)),
        upstream=upstream or FakeUpstream(),  # type: ignore[arg-type]
        clock=clock,
        auth=auth,
    )


def make_ingress(state: ServerState, max_frame_bytes: int = 4096) -> tuple[Ingress, FakeTransportWrites]:
    writes = FakeTransportWrites()
    return Ingress(state, writes, max_frame_bytes), writes


class FakeTransport:
    """Enough of asyncio.Transport for protocol unit tests."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False
        self.aborted = False
        self.reading = True
        self.unsent = 0  # what get_write_buffer_size reports: bytes the peer has not taken

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 5555) if name == "peername" else None

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def replies(self) -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in bytes(self.written).splitlines()]
