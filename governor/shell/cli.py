"""`governor serve`, `governor send` and `governor bench`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from governor import __version__
from governor.bench.config import BenchConfig
from governor.client import (
    ADDRESS_ENV,
    ADDRESS_HELP,
    DEFAULT_ADDRESS,
    NO_RETRY,
    Client,
    GovernorError,
    Yielded,
    default_address,
)
from governor.shell.config import GovernorConfig
from governor.shell.config_file import config_sources, load_config, render_config
from govwire.auth import SharedSecret
from govwire.codec import encode_error, encode_yield
from govwire.errors import WorkerUnavailable
from govwire.logs import configure_logging
from govwire.options import ConfigError, add_options, from_namespace, given
from govwire.vocab import Priority

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_YIELDED = 3


def _add_client_options(parser: argparse.ArgumentParser) -> None:
    # The clients' one convention (send, status, bench): where to connect is one --address, as
    # --worker names an endpoint; --host/--port are what `serve` listens on.
    parser.add_argument(
        "--address",
        default=default_address(),
        help=f"{ADDRESS_HELP} (default: ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="socket timeout in seconds (default: 60)")
    parser.add_argument("--auth-token-file", metavar="PATH", help="the governor's shared secret, if it wants one")


def _client(args: argparse.Namespace) -> Client:
    """A client from the common options; SystemExit naming the problem if it cannot connect."""
    try:
        token = SharedSecret.read(args.auth_token_file).token.decode() if args.auth_token_file else None
    except ValueError as exc:
        raise SystemExit(f"governor {args.command}: error: --auth-token-file: {exc}") from None
    try:
        return Client(address=args.address, token=token, timeout=args.timeout, retry=NO_RETRY)
    except ValueError as exc:  # the address does not parse (the token was checked above)
        raise SystemExit(f"governor {args.command}: error: --address: {exc}") from None
    except OSError as exc:
        raise SystemExit(connect_failure(args.command, args.address, exc)) from None


def connect_failure(command: str, address: str, exc: OSError) -> str:
    """One line for a client subcommand that could not connect; a refused TCP connect most often
    means no governor was started, so it says how to start one."""
    hint = " (is the governor running? `make run` starts one)" if isinstance(exc, ConnectionRefusedError) else ""
    return f"governor {command}: error: {address}: {exc}{hint}"


def _failed(prefix: str, exc: GovernorError | OSError) -> int:
    """Report an error reply (its code and message) or a connection failure (ConnectionLost,
    TimeoutError) on stderr."""
    detail = f"code={exc.code} message={exc.message}" if isinstance(exc, GovernorError) else str(exc)
    print(prefix + detail, file=sys.stderr)
    return EXIT_ERROR


def build_parser() -> argparse.ArgumentParser:
    """`governor` and its subcommands: `serve` and `bench` take their options from their config
    dataclass (each declared once), `send` and `status` are clients with a few flags of their own."""
    parser = argparse.ArgumentParser(prog="governor", description="TCP ingress governor for inference workers")
    parser.add_argument("--version", action="version", version=f"governor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the governor (spawns one worker unless --worker is given)",
        description="Run the governor. Arguments after a literal -- go to the spawned worker.",
    )
    add_options(serve, GovernorConfig)
    serve.set_defaults(subparser=serve)  # whose usage an invalid setting is reported with
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (flags > GOVERNOR_* environment > --config file > defaults) and exit",
    )

    _add_send_options(sub.add_parser("send", help="send one generate frame and print the streamed reply"))

    status = sub.add_parser("status", help="one screen of caps, load, rates, yields and worker health")
    _add_client_options(status)
    status.add_argument("--interval", type=float, default=1.0, help="seconds between the two samples (default: 1)")

    bench = sub.add_parser(
        "bench",
        help="drive a running governor (or --direct a worker) with a workload and report latency figures",
    )
    add_options(bench, BenchConfig)
    bench.set_defaults(subparser=bench)
    return parser


def _add_send_options(send: argparse.ArgumentParser) -> None:
    """`send`'s prompt and the generate frame's fields, beside the clients' common options."""
    send.add_argument("prompt", help="the prompt (- reads it from stdin); size and sha256 are computed for you")
    _add_client_options(send)
    send.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default: 16)")
    send.add_argument("--temperature", type=float, help="sampling temperature; 0 = greedy")
    send.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    send.add_argument("--top-k", type=int, help="sample among the k most likely tokens; 0 = off")
    send.add_argument("--seed", type=int, help="seed for reproducible sampling")
    send.add_argument("--no-stop-on-eos", action="store_true", help="keep generating past end-of-sequence")
    send.add_argument("--no-stream", action="store_true", help="ask for the final reply only")
    send.add_argument(
        "--tenant",
        help="the tenant the frame speaks for (with --tenant-from auth it must be the token's own tenant)",
    )
    send.add_argument(
        "--priority",
        choices=[p.value for p in Priority],
        help="the frame's class: sheddable frames yield first as the governor saturates (default: standard)",
    )
    send.add_argument("--json", action="store_true", help="print every reply frame as JSON")
    send.add_argument(
        "--wait-s",
        type=float,
        default=30.0,
        help="while the governor has no worker up yet (it is starting), retry for this long (default: 30; 0: no wait)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    worker_args: list[str] = []
    if "--" in args_list:
        cut = args_list.index("--")
        args_list, worker_args = args_list[:cut], args_list[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "serve":
        flags = given(GovernorConfig, args)
        try:
            config = load_config(flags, tuple(worker_args))
        except ConfigError as exc:
            args.subparser.error(str(exc))
        if args.print_config:
            sys.stdout.write(render_config(config, config_sources(flags, os.environ)))
            return 0
        return _serve(config)
    if worker_args:
        parser.error("arguments after -- are only for 'governor serve'")
    if args.command == "bench":
        try:
            bench_config = from_namespace(BenchConfig, args)
        except ConfigError as exc:
            args.subparser.error(str(exc))
        from governor.bench.main import run_bench

        try:
            return run_bench(bench_config)
        except OSError as exc:  # unreachable, connection lost
            raise SystemExit(connect_failure("bench", bench_config.direct or bench_config.address, exc)) from None
    if args.command == "status":
        return _status(args)
    return _send(args)


def _status(args: argparse.Namespace) -> int:
    from governor.report.status import render_status

    if not args.interval > 0:
        raise SystemExit("governor status: error: --interval must be > 0")
    try:
        with _client(args) as client:
            before = client.stats()
            time.sleep(args.interval)
            after = client.stats()
    except (GovernorError, OSError) as exc:
        return _failed("governor status: error: ", exc)
    sys.stdout.write(render_status(before, after, args.interval))
    return 0


def _serve(config: GovernorConfig) -> int:
    from governor.shell.server import Server

    configure_logging(config.log_level, "governor", config.log_format)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # platforms without uvloop still work, slower
        runner = asyncio.Runner()
    with runner:
        try:
            return runner.run(Server(config).serve())
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # One line naming the flag, not a traceback (a second `make run`, say).
            ports = {"--port": config.port, "--metrics-port": config.metrics_port, "--http-port": config.http_port}
            taken = " / ".join(f"{flag} {port}" for flag, port in ports.items() if port and f", {port})" in str(exc))
            print(f"governor serve: error: {taken or 'a port'} is already in use", file=sys.stderr)
            return 2


# C0 and C1 control characters other than tab and newline, written as escapes: a random-weights
# model's output would otherwise ring the bell or move the cursor of the terminal it is sent to.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def printable(text: str) -> str:
    return text.translate(_CONTROL)


def _send(args: argparse.Namespace) -> int:
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    fields: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "stream": not args.no_stream}
    for name in ("temperature", "top_p", "top_k", "seed", "tenant", "priority"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.no_stop_on_eos:
        fields["stop_on_eos"] = False
    deadline = time.monotonic() + args.wait_s
    while True:
        _await_worker(args, deadline)
        try:
            return _send_once(args, fields, sys.stdout)
        except WorkerUnavailable as exc:  # gone again between the poll and the frame, or the wait ran out
            if time.monotonic() >= deadline:
                return _failed("error: ", exc)
            time.sleep(0.25)  # up by `stats` yet refused: not in a tight loop of failed requests


def _await_worker(args: argparse.Namespace, deadline: float) -> None:
    """Right after `make run` the worker may still be loading: wait until the governor has an
    endpoint up (or `deadline`), asking with `stats`, a control frame that no request counter
    counts, so the wait shows in `governor status` as nothing rather than as failed requests."""
    waiting = False
    with _client(args) as client:
        while True:
            try:
                workers = client.stats().get("workers")
            except GovernorError:  # a worker's own socket answers no `stats`: it is up
                return
            if not isinstance(workers, list) or any(w.get("up") for w in workers if isinstance(w, dict)):
                return
            if time.monotonic() >= deadline:
                return  # the request itself then says what it gets
            if not waiting:
                print("waiting for the governor's worker to come up (up to --wait-s)...", file=sys.stderr)
                waiting = True
            time.sleep(0.25)


def _send_once(args: argparse.Namespace, fields: dict[str, Any], out: TextIO) -> int:
    """One attempt; `WorkerUnavailable` goes to the caller, which waits for a worker and retries.
    With `--json` every reply is printed as its frame; else the text (streamed tokens, or with
    `--no-stream` the final text alone: a worker's socket streams regardless) on stdout and the
    rest on stderr."""
    try:
        with _client(args) as client:
            stream = client.stream(args.prompt, **fields)
            for token_ in stream:
                if args.json:
                    out.write(orjson.dumps({"status": "token", **dataclasses.asdict(token_)}).decode() + "\n")
                elif not args.no_stream:
                    out.write(printable(token_.text))
                out.flush()
            assert stream.result is not None
            reply = stream.result.reply
            if args.json:
                out.write(orjson.dumps(reply).decode() + "\n")
            else:
                out.write(printable(reply.get("text", "")) + "\n" if args.no_stream else "\n")
                print(" ".join(f"{k}={reply[k]}" for k in reply if k not in ("id", "status", "text")), file=sys.stderr)
    except Yielded as exc:
        if args.json:
            out.write(encode_yield(exc.request_id, exc.retry_hint_ms, exc.reason, exc.retry_ticket, exc.final).decode())
        print(describe_yield(exc), file=sys.stderr)
        return EXIT_YIELDED
    except WorkerUnavailable:
        raise
    except GovernorError as exc:
        if args.json:
            out.write(encode_error(exc).decode())
        return _failed("error: ", exc)
    except OSError as exc:
        return _failed("error: ", exc)
    return 0


def describe_yield(exc: Yielded) -> str:
    """A refusal in words: a final one says so (its hint is no invitation to come back), a
    retryable one says when, and with which ticket."""
    if exc.final:
        return (
            f"refused: reason={exc.reason} final=true (nothing frees within the governor's promise horizon:"
            " do not retry now)"
        )
    ticket = f" retry_ticket={exc.retry_ticket}" if exc.retry_ticket else ""
    return f"yield: reason={exc.reason} retry_hint_ms={exc.retry_hint_ms}{ticket} (retry after the hint)"
