"""govwire: the wire contract of governor, protocol v1 (docs/protocol.md).

The governor, the worker and the clients all import this package, and it imports none of them
(tests/unit/test_layers.py checks): its only dependencies are the standard library and orjson.

- `vocab`: every word of the protocol (ops, statuses, reserved ids, reasons, error codes, limits)
- `framing`: newline splitting under a frame-size cap
- `codec`: decoding a frame, and an encoder for every reply
- `request`: the generate request and the checks of a client frame
- `messages`: the typed payloads a worker sends back (`Completion` for `done`, `EngineStats`)
- `errors`: one exception class per error code
- `auth`, `address`: the shared secret and the address syntax, the same on both hops
- `options`, `logs`: process plumbing both programs share (flags from a config dataclass, logging)
"""

__version__ = "0.1.0"
"""The release of the governor distribution (the governor, the worker, the clients): one number, read
by pyproject.toml and by both programs' --version."""
