"""Worker addresses: `unix:PATH` or `HOST:PORT` (IPv6 as `[::1]:PORT`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Address:
    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def is_unix(self) -> bool:
        return bool(self.path)

    def __str__(self) -> str:
        if self.path:
            return f"unix:{self.path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    """Parse an address flag; raises ValueError with the offending text."""
    if text.startswith("unix:"):
        path = text[5:]
        if not path:
            raise ValueError(f"address {text!r}: unix: needs a socket path")
        return Address(path=path)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {text!r}: expected unix:PATH or HOST:PORT")
    return Address(host=host.strip("[]"), port=int(port))


async def open_connection(address: Address, protocol_factory: Callable[[], asyncio.Protocol]) -> asyncio.Transport:
    loop = asyncio.get_running_loop()
    if address.is_unix:
        transport, _ = await loop.create_unix_connection(protocol_factory, address.path)
    else:
        transport, _ = await loop.create_connection(protocol_factory, address.host, address.port)
    return transport


async def start_listener(
    address: Address, protocol_factory: Callable[[], asyncio.Protocol], backlog: int = 1024
) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    if address.is_unix:
        if os.path.exists(address.path):
            os.unlink(address.path)  # a stale socket from a killed predecessor
        umask = os.umask(0o177)  # created 0600: only our own user may connect, from the first moment
        try:
            return await loop.create_unix_server(protocol_factory, address.path, backlog=backlog)
        finally:
            os.umask(umask)
    return await loop.create_server(protocol_factory, address.host, address.port, backlog=backlog)
