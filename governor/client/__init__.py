"""Python clients for the governor's protocol v1.

    from governor.client import Client
    with Client() as client:
        print(client.generate("Hello", max_new_tokens=16).text)

`Client` blocks, `AsyncClient` is the same for asyncio. Both keep one connection, pipeline
requests over it, compute `size` and `sha256` themselves, raise `Yielded` or the `GovernorError`
subclass of each error code, and retry yields after their hint under a `RetryPolicy`.
"""

from governor.client.aio import AsyncClient, AsyncStream
from governor.client.retry import NO_RETRY, RetryBudget, RetryPolicy, Yielded
from governor.client.session import ConnectionLost, Result, Token
from governor.client.sync import Client, Stream
from governor.client.where import ADDRESS_ENV, ADDRESS_HELP, DEFAULT_ADDRESS, default_address
from govwire.errors import GovernorError
from govwire.vocab import MAX_REPLY_BYTES

__all__ = [
    "ADDRESS_ENV",
    "ADDRESS_HELP",
    "DEFAULT_ADDRESS",
    "MAX_REPLY_BYTES",
    "NO_RETRY",
    "AsyncClient",
    "AsyncStream",
    "Client",
    "ConnectionLost",
    "GovernorError",
    "Result",
    "RetryBudget",
    "RetryPolicy",
    "Stream",
    "Token",
    "Yielded",
    "default_address",
]
