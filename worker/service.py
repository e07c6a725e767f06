"""The worker's socket server: NDJSON frames from the governor in, backend events out.

Speaks the contract (govwire) like the governor does: its framing, request checks and encoders.
Its lifecycle has four phases (`start_up`, `run`, `drain`, `shut_down`, in `serve`) and one
teardown stack: every resource is registered on it the moment it exists, so it is released in
reverse order whichever phase failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from govwire.address import Address, parse_address, start_listener
from govwire.auth import SharedSecret, auth_candidate, authenticate
from govwire.codec import (
    decode,
    encode_accepted,
    encode_authenticated,
    encode_done,
    encode_error,
    encode_pong,
    encode_stats_push,
    encode_token,
)
from govwire.errors import (
    DuplicateId,
    FrameTooLarge,
    GovernorError,
    RequestRejected,
    Unauthorized,
    UnknownOp,
    WorkerUnavailable,
)
from govwire.framing import TOO_LARGE, Item, LineSplitter
from govwire.messages import Completion
from govwire.request import IntegrityMode, Limits, checked_request, frame_op
from govwire.vocab import WORKER_MAX_FRAME_BYTES, Op
from worker.backends.base import Backend, RequestHandle
from worker.config import WorkerConfig

log = logging.getLogger("worker.service")
T = TypeVar("T")

# Compared for every frame: module globals (an enum member read through its class costs ~75 ns on 3.11).
_CANCEL, _PING, _AUTH, _GENERATE = Op.CANCEL, Op.PING, Op.AUTH, Op.GENERATE

CANCEL_GRACE_S = 1.0  # after the drain deadline, how long cancelled requests get to answer
# The governor already enforced its limits; the worker re-validates shape, not policy.
WORKER_LIMITS = Limits(max_new_tokens=1 << 30, integrity=IntegrityMode.OPTIONAL)


class StoppedWhileLoading(Exception):
    """SIGTERM or SIGINT came before the backend had loaded: nothing runs, nothing to drain."""


class _Sink:
    """Routes one request's backend events to its connection under the governor's id."""

    __slots__ = ("_conn", "_id")

    def __init__(self, conn: WorkerConnection, request_id: str) -> None:
        self._conn = conn
        self._id = request_id

    def token(self, index: int, token_id: int | None, text: str) -> None:
        self._conn.queue(encode_token(self._id, index, token_id, text))

    def done(self, completion: Completion) -> None:
        self._conn.settle(self._id, encode_done(self._id, completion))

    def error(self, error: GovernorError) -> None:
        self._conn.settle(self._id, encode_error(error, self._id))


@dataclass
class WorkerState:
    """What every governor link of this worker shares."""

    backend: Backend
    secret: SharedSecret | None
    open: set[WorkerConnection] = field(default_factory=set)  # authenticated links (they get stats)
    draining: bool = False  # after SIGTERM: running requests finish, new ones are refused

    @property
    def running(self) -> int:
        return sum(link.running for link in self.open)


class WorkerConnection(asyncio.Protocol):
    """One governor link. Frames emitted during one loop iteration leave in one write."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._authenticated = state.secret is None
        self._transport: asyncio.Transport | None = None
        self._splitter = LineSplitter(WORKER_MAX_FRAME_BYTES)
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._active: dict[str, RequestHandle] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if self._authenticated:
            self._open()

    def _open(self) -> None:
        self._state.open.add(self)  # from now on it gets the pushed statistics
        self.queue(encode_stats_push(self._state.backend.stats()))

    def data_received(self, data: bytes) -> None:
        for line in self._splitter.feed(data):
            if self._transport is None or self._transport.is_closing():
                return
            if not self._authenticated:
                if line:
                    self._authenticate(line)
            elif line is TOO_LARGE:
                self.queue(encode_error(FrameTooLarge(f"frame exceeds {WORKER_MAX_FRAME_BYTES} bytes")))
            elif line:
                self._handle(line)

    def _authenticate(self, line: Item) -> None:
        """The first frame must carry the governor's secret; anything else closes the link."""
        frame = auth_candidate(line)
        try:
            rid = authenticate(frame, self._state.secret).id
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
            if op == _CANCEL:
                rid = frame.get("id")
                handle = self._active.get(rid) if type(rid) is str else None
                if handle is not None:
                    handle.cancel()
                return
            if op == _PING:
                self.queue(encode_pong(str(frame.get("id"))))
                return
            if op == _AUTH:  # a governor holding a secret this worker does not ask for: welcome
                self.queue(encode_authenticated(authenticate(frame, None).id))
                return
            if frame_op(frame) != _GENERATE:
                raise UnknownOp("the worker serves generate, cancel, ping and auth", frame.get("id"))
            request = checked_request(frame, WORKER_LIMITS)
            if self._state.draining:
                self.queue(encode_error(WorkerUnavailable("the worker is shutting down", request.id)))
                return
            if request.id in self._active:
                raise DuplicateId(f"id {request.id!r} is already running", request.id)
        except RequestRejected as exc:
            self.queue(encode_error(exc))
            return
        if request.ack:  # a client talking to the worker directly (the governor never forwards ack)
            self.queue(encode_accepted(request.id))
        self._active[request.id] = self._state.backend.submit(request, _Sink(self, request.id))

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
        self._state.open.discard(self)
        for handle in list(self._active.values()):
            handle.cancel()


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(0.5)
    log.warning("event=parent_gone parent_pid=%d", parent_pid)
    stop.set()


async def _push_stats(state: WorkerState, interval_s: float) -> None:
    """Backend statistics, pushed to every authenticated link under a reserved id (the governor
    exports them as metrics)."""
    while True:
        await asyncio.sleep(interval_s)
        if state.open:
            frame = encode_stats_push(state.backend.stats())
            for conn in state.open:
                conn.queue(frame)


def make_backend(config: WorkerConfig) -> Backend:
    if config.engine == "echo":
        from worker.backends.echo import EchoBackend

        return EchoBackend(config.token_delay_ms, config.first_token_delay_ms)
    from worker.backends.gpt2 import GPT2Backend

    return GPT2Backend(config)


class WorkerServer:
    """The worker process's lifecycle: start-up, run until stopped, drain, shut down."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.stop = asyncio.Event()

    async def start_up(self, stack: contextlib.AsyncExitStack) -> tuple[WorkerState, asyncio.Server]:
        """Load the backend, then listen (only once it can serve) and start the background tasks."""
        config = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
            stack.callback(loop.remove_signal_handler, sig)
        # Loading takes seconds (torch's import, the weights): in a thread, so that a SIGTERM meanwhile
        # is heard at once rather than after the load (a governor stopped while its worker loads).
        backend = await self._unless_stopped(asyncio.to_thread(make_backend, config))
        await self._unless_stopped(backend.start())
        stack.push_async_callback(backend.close)
        state = WorkerState(backend, config.secret())
        address = parse_address(config.listen)
        server = await start_listener(address, lambda: WorkerConnection(state))
        stack.callback(_remove_socket, address)
        stack.callback(server.close)
        _start_task(stack, _push_stats(state, config.stats_interval_s))
        if config.parent_pid:
            _start_task(stack, _watch_parent(config.parent_pid, self.stop))
        log.info("event=worker_ready listen=%s engine=%s pid=%d", address, config.engine, os.getpid())
        return state, server

    async def _unless_stopped(self, work: Awaitable[T]) -> T:
        """`work`'s result, or `StoppedWhileLoading` as soon as a stop is asked for."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not task.done():
            raise StoppedWhileLoading
        return task.result()

    async def run(self) -> None:
        await self.stop.wait()

    async def drain(self, state: WorkerState, server: asyncio.Server) -> None:
        """Stop accepting links, let running requests finish (new ones are refused), then cancel
        what is left and give the cancellations a moment to be written: a worker stopped on its
        own (e.g. by Kubernetes, beside its governor) does not cut its requests short."""
        server.close()
        state.draining = True
        loop = asyncio.get_running_loop()
        timeout_s = self.config.drain_timeout_s
        log.info("event=worker_draining running=%d timeout_s=%g", state.running, timeout_s)
        deadline = loop.time() + timeout_s
        while state.running and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if state.running:
            log.warning("event=worker_drain_timeout cancelling=%d", state.running)
            for link in list(state.open):
                link.cancel_all()
            deadline = loop.time() + CANCEL_GRACE_S
            while state.running and loop.time() < deadline:
                await asyncio.sleep(0.02)

    async def serve(self) -> int:
        async with contextlib.AsyncExitStack() as stack:  # shut down: the stack unwinds
            state, server = await self.start_up(stack)
            await self.run()
            await self.drain(state, server)
        log.info("event=worker_stopped")
        return 0


def _start_task(stack: contextlib.AsyncExitStack, coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(coro)
    stack.callback(task.cancel)


def _remove_socket(address: Address) -> None:
    if address.is_unix and os.path.exists(address.path):
        os.unlink(address.path)


async def serve(config: WorkerConfig) -> int:
    return await WorkerServer(config).serve()
