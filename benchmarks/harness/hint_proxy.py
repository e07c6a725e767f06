"""Rival retry-hint rules, applied by a thin HTTP proxy in front of the governor's front door.

benchmarks/peers/hint_policies.py asks what the governor's computed, kept hint is worth against
what other software tells a refused client. The rivals are rules for the headers of a 429, not
admission policies, so they live here, in the benchmark, rather than as governor flags: a proxy
relays every request to the front door as it came (the same body, so the governor still knows a
returning client) and every response as it came, but for a 429, whose retry headers it rewrites
by one rule:

- `ours`: nothing rewritten (the governor's `retry-after-ms`, `Retry-After`, `x-should-retry`
  and ticket), so that our hint pays the same extra hop as the rivals;
- `constant`: `retry-after-ms: 1000` and `x-should-retry: true`, a constant 1 s that the client
  does retry at (what a gateway with a fixed Retry-After tells);
- `llm-d`: llm-d's proposed rule (llm-d-router#2487, implemented in its PR #2489): `Retry-After`
  in whole seconds from an EWMA of the dispatch rate (`DrainEstimator`), nothing else; omitted
  under 1 s and before any dispatch was measured;
- `none`: no retry header at all: the client's own backoff (the openai SDK: 0.5 s, doubling, less
  up to 25% jitter);
- `final`: `x-should-retry: false` and no wait: refusing at once, a final answer.

Only 429s are rewritten; a 200's stream is relayed chunk by chunk as it arrives. The proxy is
aiohttp on both sides (server and client), a real HTTP library, in a process of its own:

    python -m benchmarks.harness.hint_proxy --upstream http://127.0.0.1:PORT --policy llm-d --port P
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from multidict import CIMultiDict

from benchmarks.harness.common import free_port, start, stop, wait_for_port

OURS, CONSTANT, LLMD, NONE, FINAL = "ours", "constant", "llm-d", "none", "final"
POLICIES = (OURS, CONSTANT, LLMD, NONE, FINAL)
CONSTANT_HINT_MS = 1000
# What a 429 may say about retrying: every rule but `ours` removes all of it before adding its own.
RETRY_HEADERS = frozenset({"retry-after", "retry-after-ms", "x-should-retry", "retry-ticket"})
# Per connection, not end to end (RFC 9110 §7.6.1), plus the framing aiohttp writes itself.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer", "upgrade"}
)
FOLD_TICK_S = 0.05  # how often the proxy gives the estimator a chance to fold (llm-d: its dispatch cycle)


@dataclass
class DrainEstimator:
    """llm-d's `drainEstimator` (llm-d-router PR #2489, pkg/epp/flowcontrol/controller/internal/
    drain.go) for its global scope, the one a single capped pool trips: dispatches counted as they
    happen and folded into an EWMA of dispatches/s (weight 0.3 on the newest window) at most once
    a second; the hint is the wait for one free slot, 1 / rate, raised to the current window's
    instantaneous rate when that is higher (a burst after an idle stretch), rounded up to whole
    seconds and capped at 30 s; none under 1 s ("a whole-second floor would over-throttle a
    fast-draining scope") and none before any dispatch was seen. Times are seconds on any
    monotonic clock."""

    last_fold: float
    alpha: float = 0.3
    fold_interval_s: float = 1.0
    cap_s: int = 30
    count: int = 0
    rate: float = 0.0
    folded: bool = False

    def record_dispatch(self) -> None:
        self.count += 1

    def maybe_fold(self, now: float) -> None:
        """Fold the window's count into the rate once `fold_interval_s` has passed (llm-d calls
        this from every dispatch cycle)."""
        elapsed = now - self.last_fold
        if elapsed < self.fold_interval_s:
            return
        self.rate = self.alpha * (self.count / elapsed) + (1 - self.alpha) * self.rate
        self.count, self.folded, self.last_fold = 0, True, now

    def current(self, now: float) -> float | None:
        """Dispatches/s, or None with nothing measured yet."""
        if not self.folded and self.count == 0:
            return None
        since = now - self.last_fold
        instant = self.count / since if since > 0 and self.count > 0 else 0.0
        return max(self.rate, instant)

    def retry_after_s(self, now: float) -> int | None:
        """The `Retry-After` a capacity rejection gets now, in whole seconds, or None for none."""
        rate = self.current(now)
        if not rate:
            return None
        projection = 1 / rate
        if projection < 1:
            return None
        return min(math.ceil(projection), self.cap_s)


Headers = list[tuple[str, str]]


def rewrite(policy: str, headers: Iterable[tuple[str, str]], retry_after_s: int | None = None) -> Headers:
    """A 429's headers as `policy` would send them (`retry_after_s`: the `llm-d` rule's value,
    None for no header). Other headers pass as they are, in their order."""
    if policy not in POLICIES:
        raise ValueError(f"unknown hint policy {policy!r}: one of {', '.join(POLICIES)}")
    kept = list(headers)
    if policy == OURS:
        return kept
    out = [(name, value) for name, value in kept if name.lower() not in RETRY_HEADERS]
    if policy == CONSTANT:
        out += [("retry-after-ms", str(CONSTANT_HINT_MS)), ("retry-after", str(math.ceil(CONSTANT_HINT_MS / 1000)))]
        out.append(("x-should-retry", "true"))
    elif policy == LLMD and retry_after_s is not None:
        out.append(("retry-after", str(retry_after_s)))
    elif policy == FINAL:
        out.append(("x-should-retry", "false"))
    return out


def end_to_end(headers: Iterable[tuple[str, str]]) -> Headers:
    return [(name, value) for name, value in headers if name.lower() not in HOP_HEADERS]


class HintProxy:
    """Relays HTTP to `upstream` (`http://host:port`), rewriting each 429 by `policy`; counts a
    dispatch for every 200 (the governor admitted the request) for the `llm-d` rule."""

    def __init__(self, upstream: str, policy: str, clock: Callable[[], float] = time.monotonic) -> None:
        rewrite(policy, [])  # an unknown policy fails here, not at the first 429
        self.upstream, self.policy, self.clock = upstream.rstrip("/"), policy, clock
        self.drain = DrainEstimator(last_fold=clock())
        self.session: ClientSession | None = None
        self.folding: asyncio.Task[None] | None = None

    async def start(self, app: web.Application) -> None:
        connector = TCPConnector(limit=0)  # no pool cap: a held request must not queue the others here
        self.session = ClientSession(connector=connector, timeout=ClientTimeout(total=None), auto_decompress=False)
        self.folding = asyncio.get_running_loop().create_task(self.fold_forever())

    async def close(self, app: web.Application) -> None:
        if self.folding is not None:
            self.folding.cancel()
        if self.session is not None:
            await self.session.close()

    async def fold_forever(self) -> None:
        while True:
            self.drain.maybe_fold(self.clock())
            await asyncio.sleep(FOLD_TICK_S)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.session is None:
            raise RuntimeError("the proxy's client session opens with its app (on_startup)")
        body = await request.read()
        async with self.session.request(
            request.method,
            self.upstream + request.rel_url.raw_path_qs,
            data=body,
            headers=end_to_end(request.headers.items()),
            allow_redirects=False,
        ) as upstream:
            headers = end_to_end(upstream.headers.items())
            if upstream.status == 429:
                now = self.clock()
                self.drain.maybe_fold(now)
                hint = self.drain.retry_after_s(now) if self.policy == LLMD else None
                rewritten = rewrite(self.policy, headers, hint)
                body = await upstream.read()
                return web.Response(status=429, reason=upstream.reason, headers=CIMultiDict(rewritten), body=body)
            if upstream.status == 200:
                self.drain.record_dispatch()
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=CIMultiDict(headers))
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def app(upstream: str, policy: str) -> web.Application:
    proxy = HintProxy(upstream, policy)
    application = web.Application()
    application.on_startup.append(proxy.start)
    application.on_cleanup.append(proxy.close)
    application.router.add_route("*", "/{path:.*}", proxy.handle)
    return application


def start_hint_proxy(upstream_port: int, policy: str, log: Path | None = None) -> tuple[Popen[bytes], int]:
    """The proxy in a process of its own (this one's CPU affinity) on a free port: (process, port)."""
    port = free_port()
    argv = ["-m", "benchmarks.harness.hint_proxy", "--upstream", f"http://127.0.0.1:{upstream_port}"]
    proc = start([*argv, "--policy", policy, "--port", str(port)], log)
    try:
        wait_for_port(port)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, help="http://host:port of the governor's front door")
    parser.add_argument("--policy", required=True, choices=POLICIES)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(app(args.upstream, args.policy), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
