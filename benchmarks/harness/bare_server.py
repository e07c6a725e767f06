"""Baseline for the yield benchmark: the least a uvloop + orjson NDJSON server can do per frame.

Splits lines, parses each frame, answers a yield-shaped reply, one write per read. No validation,
no limits, no accounting: the floor the governor's yield path is compared against.
"""

from __future__ import annotations

import asyncio
import sys

import orjson
import uvloop

_NL = orjson.OPT_APPEND_NEWLINE


class Bare(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.partial = b""

    def data_received(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = [
            orjson.dumps(
                {"id": orjson.loads(line)["id"], "status": "yield", "retry_hint_ms": 50, "reason": "inflight"},
                option=_NL,
            )
            for line in lines
        ]
        if out:
            self.transport.write(b"".join(out))


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
