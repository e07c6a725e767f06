"""The links to every endpoint, and the choice of which one takes an admitted request.

An endpoint is a worker process (worker_link.py, NDJSON) or an OpenAI-compatible server
(openai_link.py, HTTP). Admission has already chosen the endpoint (its `Grant`); `dispatch` hands
the request to that endpoint's link under a governor-assigned id, unique over all connections
(client ids are only unique per connection). Every link ends its requests through the lifecycle
it is bound to (`bind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from governor.admission.endpoint import Endpoint, OpenAITarget
from governor.lifecycle import InflightRequest, Lifecycle
from governor.links.health import HealthPolicy
from governor.links.openai_link import OpenAILink
from governor.links.worker_link import WorkerLink
from govwire.address import Address
from govwire.auth import SharedSecret
from govwire.errors import WorkerUnavailable
from govwire.request import GenerateRequest


class Upstream:
    """The set of links and the choice of which one takes a request."""

    def __init__(
        self,
        endpoints: Sequence[tuple[Address | OpenAITarget, Endpoint]],
        health: HealthPolicy | None = None,
        secret: SharedSecret | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # `clock`: the governor's (ServerState's), so that a link times a token, and an endpoint's
        # pause, on the clock the lifecycle and admission read.
        self.links: list[WorkerLink | OpenAILink] = [
            OpenAILink(target, endpoint, clock)
            if isinstance(target, OpenAITarget)
            else WorkerLink(target, endpoint, secret, clock)
            for target, endpoint in endpoints
        ]
        self.health = health or HealthPolicy()
        self._link_of = {link.endpoint: link for link in self.links}
        self._next_uid = 0
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def worker_links(self) -> list[WorkerLink]:
        """The links to worker processes (those the governor may spawn, and that push engine stats)."""
        return [link for link in self.links if isinstance(link, WorkerLink)]

    @property
    def num_up(self) -> int:
        return sum(link.endpoint.up for link in self.links)

    def not_ready(self) -> str | None:
        """None while an endpoint is up; else why none is, one line per endpoint (/readyz's body)."""
        if self.num_up:
            return None
        lines = [f"{_named(link)}: {link.down_reason or 'not answered yet'}" for link in self.links]
        return "no endpoint up\n" + "\n".join(lines) + "\n"

    def bind(self, lifecycle: Lifecycle) -> None:
        """Where every link's answers go: the lifecycle that dispatches to them (ServerState)."""
        for link in self.links:
            link.lifecycle = lifecycle

    def dispatch(self, request: InflightRequest, generate: GenerateRequest) -> None:
        """Hand an admitted request to the link of the endpoint admission granted it."""
        endpoint = request.grant.endpoint
        link = None if endpoint is None else self._link_of[endpoint]
        if link is None or not link.endpoint.up:
            raise WorkerUnavailable("no worker is connected; retry later", request.client_id)
        self._next_uid += 1
        uid = format(self._next_uid, "x")
        link.submit(uid, request, generate)  # may refuse it (a field the endpoint cannot take)
        request.uid = uid
        request.link = link

    def forget(self, request: InflightRequest) -> None:
        if request.link is not None:
            request.link.inflight.pop(request.uid, None)

    def cancel(self, request: InflightRequest) -> None:
        if request.link is not None:
            request.link.cancel(request.uid)

    def describe(self) -> list[dict[str, Any]]:
        return [link.describe() for link in self.links]

    def start(self) -> None:
        self._tasks = [asyncio.create_task(link.maintain(self.health)) for link in self.links]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self.links:
            link.close()


def _named(link: WorkerLink | OpenAILink) -> str:
    """Its endpoint's name (its metrics label), with its address where that is another."""
    name = link.endpoint.name
    return name if name == str(link.address) else f"{name} ({link.address})"
