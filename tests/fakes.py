"""Test doubles for unit tests (integration tests use the real processes)."""

from __future__ import annotations

import random
from typing import Any

import orjson

from governor.admission.appointments.books import PrepaidBook
from governor.admission.buckets import TokenBucket
from governor.admission.caps import Caps
from governor.admission.cost import CostModel
from governor.admission.decision import Admission
from governor.admission.endpoint import Endpoint, EndpointLimits
from governor.admission.fair_share import DEFAULT_SHARE_THRESHOLD
from governor.admission.hints import RetryHintEstimator, RetryHintPolicy
from governor.admission.priority import CeilingPolicy
from governor.admission.tenant import TenantLimits
from governor.doors.ndjson import Ingress
from governor.lifecycle import InflightRequest, Lifecycle
from governor.links.worker_link import WorkerLink
from governor.state import ServerState
from govwire.address import Address
from govwire.auth import TenantSecrets
from govwire.codec import encode, encode_done
from govwire.errors import WorkerUnavailable
from govwire.messages import Completion
from govwire.request import GenerateRequest, IntegrityMode, Limits
from govwire.vocab import FinishReason, Op


def done_frame(
    request_id: str,
    text: str = "",
    finish_reason: str = "eos",
    prompt_tokens: int = 1,
    completion_tokens: int | None = None,
) -> dict[str, Any]:
    """A worker's `done` frame, parsed, as the contract's encoder writes it."""
    completion = Completion(
        text,
        prompt_tokens,
        len(text) if completion_tokens is None else completion_tokens,
        FinishReason(finish_reason),
        queue_wait_ms=0.0,
    )
    frame: dict[str, Any] = orjson.loads(encode_done(request_id, completion))
    return frame


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeTimer:
    def __init__(self, at: float, callback: Any, args: tuple[Any, ...]) -> None:
        self.at, self.callback, self.args = at, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeTimers:
    """Deadlines on a FakeClock: `fire_due` runs the callbacks whose time has come."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.timers: list[FakeTimer] = []

    def call_later(self, delay: float, callback: Any, *args: Any) -> FakeTimer:
        timer = FakeTimer(self.clock() + delay, callback, args)
        self.timers.append(timer)
        return timer

    def fire_due(self) -> int:
        due = [t for t in self.timers if not t.cancelled and t.at <= self.clock()]
        self.timers = [t for t in self.timers if not t.cancelled and t.at > self.clock()]
        for timer in due:
            timer.callback(*timer.args)
        return len(due)


class FakeLink:
    def __init__(self) -> None:
        self.address = "fake"
        self.inflight: dict[str, InflightRequest] = {}
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


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
        request.link = self.link
        self.link.inflight[request.uid] = request
        self.dispatched[request.uid] = (request, generate)

    def forget(self, request: InflightRequest) -> None:
        self.link.inflight.pop(request.uid, None)

    def cancel(self, request: InflightRequest) -> None:
        self.sent_frames.append({"id": request.uid, "op": Op.CANCEL})

    def bind(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    def worker_sends(self, *frames: dict[str, Any] | bytes) -> None:
        """Frames from the worker for the requests dispatched here, read by a real worker link
        (WorkerLink.data_received: a token by its bytes, any other frame parsed), which ends them
        through the lifecycle and flushes their owners."""
        reader = WorkerLink(Address(path="fake"), Endpoint("fake", EndpointLimits(), 0.0))
        reader.inflight = self.link.inflight
        reader.lifecycle = self.lifecycle
        reader.data_received(b"".join(f if isinstance(f, bytes) else encode(f) for f in frames))

    def describe(self) -> list[dict[str, Any]]:
        return []


class FakeTransportWrites:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        self.chunks.append(data)

    def lines(self) -> list[bytes]:
        return b"".join(self.chunks).splitlines()


def worker_sends(state: ServerState, *frames: dict[str, Any] | bytes) -> None:
    """FakeUpstream.worker_sends on the state's upstream."""
    upstream = state.upstream
    assert isinstance(upstream, FakeUpstream)
    upstream.worker_sends(*frames)


def make_state(
    max_inflight: int = 2,
    integrity: IntegrityMode = IntegrityMode.REQUIRED,
    clock: FakeClock | None = None,
    upstream: FakeUpstream | None = None,
    max_new_tokens: int = 64,
    hint_policy: RetryHintPolicy | None = None,
    endpoints: list[Endpoint] | None = None,
    auth: TenantSecrets | None = None,
    timers: FakeTimers | None = None,
    costs: CostModel | None = None,
    tenants: dict[str, TenantLimits] | None = None,
    tenant_from_frame: bool = False,
    share_threshold: float = DEFAULT_SHARE_THRESHOLD,
    ceilings: CeilingPolicy | None = None,
    preempt: bool = True,
    tenant_loan: int = 0,
    **token_caps: Any,
) -> ServerState:
    """A state over one endpoint that is up (or `endpoints`), with a seeded hint jitter;
    `token_caps`: max_inflight_tokens, tokens_per_s and tokens_burst (caps.Caps), and Admission's
    other keyword arguments;
    the tenant table holds `tenants`, the names `auth` gives, and the default one."""
    clock = clock or FakeClock()
    if endpoints is None:
        endpoint = Endpoint("fake", EndpointLimits(), clock())
        endpoint.up = True
        endpoints = [endpoint]
    hints = RetryHintEstimator(hint_policy or RetryHintPolicy(), max_inflight, rng=random.Random(7))
    caps = Caps(
        max_inflight=max_inflight,
        max_inflight_tokens=token_caps.pop("max_inflight_tokens", 0),
        max_tokens_per_s=token_caps.pop("tokens_per_s", 0.0),
        tokens_burst=token_caps.pop("tokens_burst", 0.0),
    )
    admission = Admission(endpoints, caps, hints, clock(), served=True, **token_caps)
    implicit = auth.tenants if auth is not None else frozenset()
    admission.set_tenancy(
        tenants or {}, implicit, share_threshold, ceilings or CeilingPolicy(), clock(), preempt, tenant_loan
    )
    return ServerState(
        limits=Limits(max_new_tokens=max_new_tokens, integrity=integrity),
        admission=admission,
        upstream=upstream or FakeUpstream(),
        clock=clock,
        auth=auth,
        costs=costs,
        timers=timers or FakeTimers(clock),
        tenant_from_frame=tenant_from_frame,
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


def unspent(bucket: TokenBucket | None, book: PrepaidBook | None, now: float) -> float | None:
    """What a rate cap has not spent: its bucket's level and what its appointments paid for (a
    refusal moves its client's tokens from the bucket into its book: appointments.PrepaidBook)."""
    if bucket is None:
        return None
    return round(bucket.level(now) + (book.promised if book is not None else 0.0), 9)
