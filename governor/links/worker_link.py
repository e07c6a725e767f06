"""A link to a worker process: one persistent NDJSON connection (TCP or a unix socket).

Each `WorkerLink` is one persistent NDJSON connection multiplexing many requests under
governor-assigned ids (client ids are only unique per client connection). A link that drops ends
its in-flight requests at once through the lifecycle's `lose` (re-routed once before their first
token, else `worker_lost`) and is reconnected with backoff.

Health: a connected link is pinged; its endpoint counts as up only once the worker has answered.
A link is cut and treated as lost when a ping goes unanswered for the ping timeout (a worker whose
event loop is stuck, or a peer that stopped reading), or when it holds requests but sent nothing
for any of them for the stall timeout (an engine that stopped making progress). A worker the
governor spawned is then killed too, and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import orjson

from governor.admission.endpoint import Endpoint
from governor.lifecycle import InflightRequest, Lifecycle, Phase, RequestOwner
from governor.links.health import HealthPolicy
from govwire.address import Address, open_connection
from govwire.auth import SharedSecret
from govwire.codec import TOKEN_FRAME_HEAD, TOKEN_FRAME_STATUS, encode, encode_cancel, encode_ping
from govwire.errors import InternalError, error_from_code
from govwire.framing import TOO_LARGE, LineSplitter
from govwire.messages import Completion, EngineStats
from govwire.request import GenerateRequest
from govwire.vocab import MAX_REPLY_BYTES, ReservedId, Status

# The logger keeps its name from before the file moved: it is in every log line (logger=governor.upstream).
log = logging.getLogger("governor.upstream")

RECONNECT_MIN_S = 0.02
RECONNECT_MAX_S = 1.0
UNREACHABLE_LOG_EVERY = 60  # failed connects between two `worker_unreachable` lines (~1 a minute at the max backoff)
_RESERVED_IDS = frozenset(ReservedId)  # link traffic, no request
_PING = encode_ping(ReservedId.PING.value)
# Read for every token: module globals are cheaper than the enums' attributes.
_STARTED = Phase.STARTED
_TOKEN, _DONE, _ERROR = Status.TOKEN.value, Status.DONE.value, Status.ERROR.value
_HEAD_LEN = len(TOKEN_FRAME_HEAD)


def on_reply(lifecycle: Lifecycle, request: InflightRequest, frame: dict[str, Any]) -> None:
    """A worker's parsed reply for `request` (the one place its status is read): a token that
    missed the byte path (re-encoded into the form that path reads), or its final `done` or
    `error`, which ends it in the lifecycle. Anything else is the worker's fault: `internal`."""
    status = frame.get("status")
    if status == _TOKEN:
        lifecycle.token(request)
        rest = encode({"id": "", **{key: value for key, value in frame.items() if key != "id"}})
        request.owner.worker_token(request, rest[_HEAD_LEN + 1 : -1])  # after the id's closing quote
        return
    if status == _DONE:
        try:
            completion = Completion.from_frame(frame)
        except ValueError as exc:
            log.warning("event=worker_protocol_error error=%r", str(exc))
            lifecycle.fail(request, InternalError(f"worker sent a malformed done: {exc}", request.client_id))
            return
        lifecycle.finish(request, completion)
        return
    if status == _ERROR:
        error = error_from_code(str(frame.get("code")), str(frame.get("message", "")), request.client_id)
    else:
        log.warning("event=worker_protocol_error status=%r", status)
        error = InternalError(f"worker sent an unknown status {status!r}", request.client_id)
    lifecycle.fail(request, error)


class WorkerLink(asyncio.Protocol):
    """One NDJSON connection to a worker process."""

    kind = "worker"
    lifecycle: Lifecycle  # where its requests' answers go (Upstream.bind)

    def __init__(
        self,
        address: Address,
        endpoint: Endpoint,
        secret: SharedSecret | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = str(address)
        self._secret = secret
        self._address = address
        self._clock = clock  # the governor's, which the lifecycle reads too: tokens, pings and stalls are timed on it
        self.endpoint = endpoint  # its caps and load in the pool; up while this link is connected
        self.inflight: dict[str, InflightRequest] = {}  # uid -> request
        self.pid: int | None = None  # set when the governor spawned this worker
        self.kill_worker: Callable[[], None] | None = None  # the same: its supervisor's kill
        self.answered = False  # the current connection answered a ping (it works, not just accepts)
        self.engine_stats = EngineStats()  # the worker's latest push (empty until the first)
        self._transport: asyncio.Transport | None = None
        self._splitter = LineSplitter(MAX_REPLY_BYTES)
        self._closed: asyncio.Future[None] | None = None
        self.ping_pending_since: float | None = None  # when the unanswered ping went, if any
        self.last_progress_at = 0.0  # when a request on this link last heard from the worker
        self.last_error = ""  # why it is not up (unreachable, refused, unresponsive), for /readyz and stats
        # For a spawned worker: how its process last ended (supervisor.WorkerExit), until it is up
        # again: why it is unreachable, which the socket's error does not say.
        self.exited = ""

    @property
    def down_reason(self) -> str:
        """Why it is not up: how its process ended, when the governor spawned it, else the link's error."""
        return self.exited or self.last_error

    @property
    def is_connected(self) -> bool:
        return self._transport is not None

    def describe(self) -> dict[str, Any]:
        """The link in `stats`, with the engine statistics the worker last pushed (empty until then)."""
        return {
            "address": self.address,
            "kind": self.kind,
            **self.endpoint.describe(),
            "last_error": self.down_reason,
            "pid": self.pid,
            "engine": self.engine_stats.to_dict(),
        }

    async def connect(self) -> None:
        self._splitter = LineSplitter(MAX_REPLY_BYTES)
        self._closed = asyncio.get_running_loop().create_future()
        await open_connection(self._address, lambda: self)

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await asyncio.shield(self._closed)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Cut the link without flushing: a peer that stopped reading would hold close() open.
        Down at once: nothing more may be dispatched to it before `connection_lost` runs."""
        self.endpoint.up = False
        if self._transport is not None:
            self._transport.abort()

    def probe(self, now: float, timeout_s: float) -> bool:
        """Send a ping unless one is pending; False when the pending one is older than `timeout_s`."""
        if self.ping_pending_since is None:
            self.ping_pending_since = now
            self.send(_PING)
        return now - self.ping_pending_since <= timeout_s

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Requests are in flight here but none heard anything for `timeout_s`."""
        return bool(self.inflight) and now - self.last_progress_at > timeout_s

    def submit(self, uid: str, request: InflightRequest, generate: GenerateRequest) -> None:
        """Send an admitted request under the governor's `uid` (a chat with its messages: the
        worker renders them with its chat template)."""
        if not self.inflight:
            self.last_progress_at = self._clock()  # the stall clock starts with the first request
        self.inflight[uid] = request
        frame = generate.to_frame()
        frame["id"] = uid
        self.send(encode(frame))

    def cancel(self, uid: str) -> None:
        """Ask the worker to stop a request; it answers with its `done` (finish_reason cancelled)."""
        self.send(encode_cancel(uid))

    def send(self, data: bytes) -> None:
        """Write a frame now. (Deferring writes to coalesce those of one loop iteration was
        measured: it cost one client ~0.1 ms per request and did not help sixteen.)"""
        if self._transport is not None:
            self._transport.write(data)

    async def maintain(self, health: HealthPolicy) -> None:
        """Keep the link connected. Backoff applies to connects that fail and to connections that
        end before answering a ping (a worker refusing our secret), so neither spins."""
        delay = RECONNECT_MIN_S
        failures = 0  # connects failed in a row: the first is logged, then one a minute or so
        while True:
            try:
                await self.connect()
            except OSError as exc:
                self.last_error = f"unreachable: {exc.strerror or exc}"
                if failures % UNREACHABLE_LOG_EVERY == 0:
                    # A worker the governor spawned is unreachable until it has bound its socket,
                    # and its supervisor logs what goes wrong with it (worker_exited, stalls).
                    log.log(
                        logging.DEBUG if self.kill_worker is not None else logging.WARNING,
                        "event=worker_unreachable worker=%s error=%r attempts=%d",
                        self.address,
                        str(exc),
                        failures + 1,
                    )
                failures += 1
            else:
                failures = 0
                await self._watch(health)
                if self.answered:
                    delay = RECONNECT_MIN_S
                    continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _watch(self, health: HealthPolicy) -> None:
        """Ping a connected link until it closes; cut it when it stops answering or progressing."""
        while self.is_connected:
            now = self._clock()
            if not self.probe(now, health.ping_timeout_s):
                self._give_up(f"ping unanswered for {health.ping_timeout_s:g} s")
                break
            if self.stalled(now, health.stall_timeout_s):
                self._give_up(f"no progress for {health.stall_timeout_s:g} s with requests in flight")
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait_closed(), health.ping_interval_s)
        await self.wait_closed()

    def _give_up(self, why: str) -> None:
        """Declare the worker lost: cut the link (its requests fail or are re-routed) and, if the
        governor spawned it, kill it so that its supervisor starts a fresh one."""
        self.last_error = f"unresponsive: {why}"
        log.error("event=worker_unresponsive worker=%s pid=%s why=%r", self.address, self.pid, why)
        self.abort()
        if self.kill_worker is not None:
            self.kill_worker()

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.ping_pending_since = None
        self.answered = False
        if self._secret is not None:
            self.send(encode({"id": ReservedId.AUTH.value, **self._secret.frame()}))
        # Connected, not yet accepted: `worker_up` (INFO) follows its first answer, or
        # `worker_refused` (ERROR) a refusal of our secret.
        log.debug("event=worker_connected worker=%s", self.address)

    def data_received(self, data: bytes) -> None:
        """Token frames take the byte path (re-addressed without parsing); every other line is
        parsed and goes to `_on_link_frame` (reserved ids) or `on_reply` (a request's)."""
        touched: set[RequestOwner] = set()
        inflight = self.inflight
        lifecycle = self.lifecycle
        now = self._clock()
        for line in self._splitter.feed(data):
            if type(line) is bytes and line.startswith(TOKEN_FRAME_HEAD):
                close = line.find(b'"', _HEAD_LEN)
                if close > 0 and line.startswith(TOKEN_FRAME_STATUS, close):
                    request = inflight.get(line[_HEAD_LEN:close].decode("ascii", "replace"))
                    if request is not None:
                        self.last_progress_at = now
                        # Lifecycle.token, inlined: this runs for every generated token.
                        request.tokens_seen += 1
                        request.t_last_token = now
                        if request.phase is not _STARTED:
                            lifecycle.start(request)
                        request.owner.worker_token(request, line[close + 1 :])
                        touched.add(request.owner)
                    continue
            try:
                if line is TOO_LARGE:
                    raise ValueError("frame too large")
                frame = orjson.loads(line)
                rid = frame["id"]
                if type(rid) is not str:
                    raise ValueError("frame without a request id")
            except (orjson.JSONDecodeError, ValueError, TypeError, KeyError) as exc:
                # A reply we cannot attribute may have been some request's final one: rather than
                # leave that request hanging, treat the link as broken. connection_lost then fails
                # everything in flight on it with worker_lost, and the link reconnects.
                preview = line[:200] if isinstance(line, bytes) else line
                log.error("event=worker_protocol_error worker=%s error=%r frame=%r", self.address, exc, preview)
                self.close()
                break
            if rid in _RESERVED_IDS:
                self._on_link_frame(rid, frame, now)
                continue
            request = inflight.get(rid)
            if request is None:
                continue  # already settled (cancelled by its client, or the link was reset)
            self.last_progress_at = now
            on_reply(lifecycle, request, frame)
            touched.add(request.owner)
        for owner in touched:
            owner.flush()

    def _on_link_frame(self, rid: str, frame: dict[str, Any], now: float) -> None:
        """Traffic of the link itself: the worker's statistics, a pong, or a refusal."""
        status = frame.get("status")
        if rid == ReservedId.STATS and status == Status.STATS:
            stats = EngineStats.from_frame(frame)
            if stats.steps_total != self.engine_stats.steps_total:
                # The engine is stepping: requests of ours that hear nothing are queued behind
                # others (a worker shared by several governors), not stalled.
                self.last_progress_at = now
            self.engine_stats = stats
            # How many it runs at once: past that, a request waits in the worker (deadline.py).
            if stats.max_running:
                self.endpoint.batch = stats.max_running
            # Its time per token, which the release forecast assumes until a stream of its ends.
            if stats.step_seconds is not None:
                self.endpoint.reported_step_s = stats.step_seconds
        elif status == Status.ERROR:  # e.g. unauthorized: the worker closes the link
            self.last_error = f"refused: {frame.get('code')}: {frame.get('message')}"
            log.error(
                "event=worker_refused worker=%s code=%r message=%r",
                self.address,
                frame.get("code"),
                frame.get("message"),
            )
        elif rid == ReservedId.PING:
            self.ping_pending_since = None
            self.answered = True
            if not self.endpoint.up:
                self.endpoint.up = True
                self.last_error = self.exited = ""
                log.info("event=worker_up worker=%s", self.address)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.endpoint.up = False
        self.engine_stats = EngineStats()
        lost = list(self.inflight.values())
        if lost:
            log.warning("event=worker_lost worker=%s inflight=%d", self.address, len(lost))
        owners: set[RequestOwner] = set()
        for request in lost:
            self.lifecycle.lose(request, f"connection to worker {self.address} lost")
            owners.add(request.owner)
        for owner in owners:
            owner.flush()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
