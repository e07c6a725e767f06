"""`worker serve`.

A worker that cannot start (a flag, the model path, the dtype) says why in one log line tagged
`proc=worker`, writes the same line to its exit report when a governor spawned it
($GOVERNOR_WORKER_EXIT_REPORT), and exits with `EXIT_STARTUP`, which its supervisor does not
restart in a loop: the reason will not change by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from govwire import __version__
from govwire.logs import LOG_FORMATS, configure_logging
from govwire.options import ConfigError, add_options, from_namespace
from govwire.vocab import EXIT_STARTUP, PROTOCOL_VERSION, WORKER_EXIT_REPORT_ENV
from worker.config import WorkerConfig
from worker.errors import ModelLoadError, StartupError

log = logging.getLogger("worker")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (and reported like any other start-up error) rather
    than printed and exited on."""

    def error(self, message: str) -> NoReturn:
        raise StartupError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="worker", description="inference worker behind a governor")
    parser.add_argument("--version", action="version", version=f"worker {__version__} (protocol v{PROTOCOL_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="run the worker's socket server")
    add_options(serve_parser, WorkerConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        config = from_namespace(WorkerConfig, parser.parse_args(args_list))
    except (StartupError, ConfigError) as exc:
        parser.print_usage(sys.stderr)
        return _cannot_start(str(exc), _log_format(args_list))
    configure_logging(config.log_level, "worker", config.log_format)
    from worker.service import StoppedWhileLoading, serve

    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    try:
        with runner:
            try:
                return runner.run(serve(config))
            except StoppedWhileLoading:
                # The load goes on in its thread, which closing the loop would wait for: nothing
                # runs yet and nothing holds a resource to release (the socket comes after it).
                log.info("event=worker_stopped reason=stopped_while_loading")
                sys.stderr.flush()
                os._exit(0)
    except ModelLoadError as exc:
        return _cannot_start(str(exc), config.log_format)
    except Exception as exc:  # a crash: said in the report too, then the traceback as usual
        _report(f"{type(exc).__name__}: {exc}")
        raise


def _log_format(args: list[str]) -> str:
    """--log-format as given, for the one line said when the rest of the flags could not be read."""
    alone = _Parser(add_help=False)
    alone.add_argument("--log-format", choices=LOG_FORMATS, default="logfmt")
    try:
        return str(alone.parse_known_args(args)[0].log_format)
    except StartupError:  # --log-format itself is the flag at fault
        return "logfmt"


def _cannot_start(message: str, log_format: str) -> int:
    configure_logging("info", "worker", log_format)
    log.error("event=start_failed error=%s", message)
    _report(message)
    return EXIT_STARTUP


def _report(message: str) -> None:
    """Tell the spawning governor why (one line in the file it named; nothing when run by hand)."""
    path = os.environ.get(WORKER_EXIT_REPORT_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as out:
                out.write(message.replace("\n", " ") + "\n")
        except OSError:
            pass  # the log line says it anyway
