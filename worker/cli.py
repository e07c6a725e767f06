"""`worker serve`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from govwire import __version__
from govwire.logs import configure_logging
from govwire.options import ConfigError, add_options, from_namespace
from govwire.vocab import PROTOCOL_VERSION
from worker.config import WorkerConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worker", description="inference worker behind a governor")
    parser.add_argument("--version", action="version", version=f"worker {__version__} (protocol v{PROTOCOL_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="run the worker's socket server")
    add_options(serve_parser, WorkerConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = from_namespace(WorkerConfig, args)
    except ConfigError as exc:
        parser.error(str(exc))
    configure_logging(config.log_level, "worker")
    from worker.service import serve

    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    from worker.errors import ModelLoadError

    with runner:
        try:
            return runner.run(serve(config))
        except ModelLoadError as exc:
            print(f"worker: error: {exc}", file=sys.stderr)
            return 2
