"""The worker's socket server: NDJSON frames from the governor in, engine events out.

Uses the governor's framing, validation and reply encoders, so both ends speak one protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import cast

from governor.address import parse_address, start_listener
from governor.auth import SharedSecret, auth_candidate, authenticate
from governor.errors import (
    DuplicateId,
    FrameTooLarge,
    GovernorError,
    RequestRejected,
    Unauthorized,
    UnknownOp,
    WorkerUnavailable,
)
from governor.framing import TOO_LARGE, Item, LineSplitter
from governor.validation import (
    OP_AUTH,
    OP_CANCEL,
    OP_GENERATE,
    OP_PING,
    IntegrityMode,
    Limits,
    checked_request,
    frame_op,
)
from governor.wire import (
    STATUS_DONE,
    STATUS_STATS,
    WORKER_STATS_ID,
    decode,
    encode,
    encode_accepted,
    encode_authenticated,
    encode_error,
    encode_pong,
    encode_token,
)
from worker.config import WorkerConfig
from worker.engines.base import Completion, Engine, RequestHandle

log = logging.getLogger("worker.service")

MAX_FRAME_BYTES = 32 * 1024 * 1024  # twice the governor's largest --max-frame-bytes
CANCEL_GRACE_S = 1.0  # after the drain deadline, how long cancelled requests get to answer
# The governor already enforced its limits; the worker re-validates shape, not policy.
WORKER_LIMITS = Limits(max_new_tokens=1 << 30, integrity=IntegrityMode.OPTIONAL)


class _Sink:
    """Routes one request's engine events to its connection under the governor's id."""

    __slots__ = ("_conn", "_id")

    def __init__(self, conn: WorkerConnection, request_id: str) -> None:
        self._conn = conn
        self._id = request_id

    def token(self, index: int, token_id: int, text: str) -> None:
        self._conn.queue(encode_token(self._id, index, token_id, text))

    def done(self, completion: Completion) -> None:
        frame = {
            "id": self._id,
            "status": STATUS_DONE,
            "text": completion.text,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "finish_reason": completion.finish_reason,
            "queue_wait_ms": round(completion.queue_wait_ms, 3),
        }
        for key in ("prefill_ms", "worker_ttft_ms", "decode_ms"):
            value = getattr(completion, key)
            if value is not None:
                frame[key] = round(value, 3)
        self._conn.settle(self._id, encode(frame))

    def error(self, error: GovernorError) -> None:
        self._conn.settle(self._id, encode_error(error, self._id))


@dataclass
class Links:
    """What every governor link of this worker shares."""

    engine: Engine
    secret: SharedSecret | None
    open: set[WorkerConnection] = field(default_factory=set)  # authenticated links (they get stats)
    draining: bool = False  # after SIGTERM: running requests finish, new ones are refused

    @property
    def running(self) -> int:
        return sum(link.running for link in self.open)


class WorkerConnection(asyncio.Protocol):
    """One governor link. Frames emitted during one loop iteration leave in one write."""

    def __init__(self, links: Links) -> None:
        self._links = links
        self._authenticated = links.secret is None
        self._transport: asyncio.Transport | None = None
        self._splitter = LineSplitter(MAX_FRAME_BYTES)
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._active: dict[str, RequestHandle] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if self._authenticated:
            self._open()

    def _open(self) -> None:
        self._links.open.add(self)  # from now on it gets the pushed statistics
        self.queue(stats_frame(self._links.engine))

    def data_received(self, data: bytes) -> None:
        for line in self._splitter.feed(data):
            if self._transport is None or self._transport.is_closing():
                return
            if not self._authenticated:
                if line:
                    self._authenticate(line)
            elif line is TOO_LARGE:
                self.queue(encode_error(FrameTooLarge(f"frame exceeds {MAX_FRAME_BYTES} bytes")))
            elif line:
                self._handle(line)

    def _authenticate(self, line: Item) -> None:
        """The first frame must carry the governor's secret; anything else closes the link."""
        frame = auth_candidate(line)
        try:
            rid = authenticate(frame, self._links.secret)
        except Unauthorized as exc:
            rid = frame.get("id") if type(frame) is dict and type(frame.get("id")) is str else None
            log.warning("event=link_unauthorized")
            self.queue(encode_error(exc, rid))
            self._flush()
            assert self._transport is not None
            self._transport.close()
            return
        self._authenticated = True
        self.queue(encode_authenticated(rid))
        self._open()

    def _handle(self, line: bytes) -> None:
        try:
            frame = decode(line)
            op = frame.get("op") if type(frame) is dict else None
            if op == OP_CANCEL:
                rid = frame.get("id")
                handle = self._active.get(rid) if type(rid) is str else None
                if handle is not None:
                    handle.cancel()
                return
            if op == OP_PING:
                self.queue(encode_pong(str(frame.get("id"))))
                return
            if op == OP_AUTH:  # a governor holding a secret this worker does not ask for: welcome
                self.queue(encode_authenticated(authenticate(frame, None)))
                return
            if frame_op(frame) != OP_GENERATE:
                raise UnknownOp("the worker serves generate, cancel, ping and auth", frame.get("id"))
            request = checked_request(frame, WORKER_LIMITS)
            if self._links.draining:
                self.queue(encode_error(WorkerUnavailable("the worker is shutting down", request.id)))
                return
            if request.id in self._active:
                raise DuplicateId(f"id {request.id!r} is already running", request.id)
        except RequestRejected as exc:
            self.queue(encode_error(exc))
            return
        if request.ack:  # a client talking to the worker directly (the governor never forwards ack)
            self.queue(encode_accepted(request.id))
        self._active[request.id] = self._links.engine.submit(request, _Sink(self, request.id))

    @property
    def running(self) -> int:
        return len(self._active)

    def cancel_all(self) -> None:
        for handle in list(self._active.values()):
            handle.cancel()  # each answers `done` with finish_reason "cancelled"

    def queue(self, data: bytes) -> None:
        self._pending.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def settle(self, request_id: str, data: bytes) -> None:
        self._active.pop(request_id, None)
        self.queue(data)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._pending))
        self._pending.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._links.open.discard(self)
        for handle in list(self._active.values()):
            handle.cancel()


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(0.5)
    log.warning("event=parent_gone parent_pid=%d", parent_pid)
    stop.set()


async def _drain(links: Links, timeout_s: float) -> None:
    """Let running requests finish (new ones are refused), then cancel what is left and give the
    cancellations a moment to be written: a worker stopped on its own (e.g. by Kubernetes, beside
    its governor) does not cut its requests short."""
    links.draining = True
    loop = asyncio.get_running_loop()
    log.info("event=worker_draining running=%d timeout_s=%g", links.running, timeout_s)
    deadline = loop.time() + timeout_s
    while links.running and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if links.running:
        log.warning("event=worker_drain_timeout cancelling=%d", links.running)
        for link in list(links.open):
            link.cancel_all()
        deadline = loop.time() + CANCEL_GRACE_S
        while links.running and loop.time() < deadline:
            await asyncio.sleep(0.02)


def stats_frame(engine: Engine) -> bytes:
    """Engine statistics, pushed to the governor under a reserved id (it exports them as metrics)."""
    return encode({"id": WORKER_STATS_ID, "status": STATUS_STATS, **engine.stats()})


async def _push_stats(engine: Engine, connections: set[WorkerConnection], interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        if connections:
            frame = stats_frame(engine)
            for conn in connections:
                conn.queue(frame)


def make_engine(config: WorkerConfig) -> Engine:
    if config.engine == "echo":
        from worker.engines.echo import EchoEngine

        return EchoEngine(config.token_delay_ms, config.first_token_delay_ms)
    from worker.engines.gpt2 import GPT2Engine

    return GPT2Engine(config)


async def serve(config: WorkerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = make_engine(config)
    await engine.start()
    address = parse_address(config.listen)
    links = Links(engine, config.secret())
    server = await start_listener(address, lambda: WorkerConnection(links))
    log.info("event=worker_ready listen=%s engine=%s pid=%d", address, config.engine, os.getpid())
    tasks = [asyncio.create_task(_push_stats(engine, links.open, config.stats_interval_s))]
    if config.parent_pid:
        tasks.append(asyncio.create_task(_watch_parent(config.parent_pid, stop)))
    await stop.wait()
    server.close()
    await _drain(links, config.drain_timeout_s)
    for task in tasks:
        task.cancel()
    await engine.close()
    if address.is_unix and os.path.exists(address.path):
        os.unlink(address.path)
    log.info("event=worker_stopped")
    return 0
