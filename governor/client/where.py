"""Where a client connects when it is not told: `$GOVERNOR_ADDRESS`, else the governor's default
port on loopback (as the OpenAI SDK reads `OPENAI_BASE_URL`), for the library and the CLI alike."""

from __future__ import annotations

import os

from govwire.address import Address, parse_address

DEFAULT_ADDRESS = "127.0.0.1:7070"  # where `governor serve` listens by default (--host, --port)
ADDRESS_ENV = "GOVERNOR_ADDRESS"
ADDRESS_HELP = "the governor's HOST:PORT, or unix:PATH of a worker's socket"


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def client_address(host: str | None, port: int | None, address: str | None) -> Address:
    """`address` if given; else `host` and `port` where either is (the other defaulted); else
    `default_address()`."""
    if address is not None:
        return parse_address(address)
    if host is None and port is None:
        return parse_address(default_address())
    default = parse_address(DEFAULT_ADDRESS)
    return Address(host=default.host if host is None else host, port=default.port if port is None else port)
