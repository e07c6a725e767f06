"""One line per event, `key=value` pairs, to stderr; quiet unless something happens."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str, name: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"ts=%(asctime)s.%(msecs)03d level=%(levelname)s proc={name} logger=%(name)s %(message)s",
            datefmt="%Y-%m-%dT%H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx (the OpenAI-compatible upstreams) logs every request at INFO: one line per request
    # is not an event. Its warnings still show.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
