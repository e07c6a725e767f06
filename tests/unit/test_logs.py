"""The log lines (govwire/logs.py): every log call of the code is a logfmt template, each value
quoted where logfmt needs it, and the same record renders as one JSON object."""

from __future__ import annotations

import ast
import logging
import shlex
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.doors.connection import peer_text
from govwire.logs import JsonFormatter, LogfmtFormatter, logfmt_value, template_fields

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def _log_calls() -> list[tuple[str, str, int]]:
    """(where, template, arguments) of every `log.<level>("...", ...)` / `log.log(level, "...")`."""
    calls = []
    for package in ("govwire", "governor", "worker"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                target, method = node.func.value, node.func.attr
                if not (isinstance(target, ast.Name) and target.id == "log"):
                    continue
                args = node.args[1:] if method == "log" else node.args if method in LEVELS else None
                if not args or not isinstance(args[0], ast.Constant) or not isinstance(args[0].value, str):
                    continue
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", args[0].value, len(args) - 1))
    return calls


CALLS = _log_calls()


def test_there_are_log_calls_to_check() -> None:
    assert len(CALLS) > 50


@pytest.mark.parametrize(("where", "template", "arguments"), CALLS, ids=[c[0] for c in CALLS])
def test_every_log_call_is_a_logfmt_template_with_one_argument_per_specifier(
    where: str, template: str, arguments: int
) -> None:
    fields = template_fields(template)
    assert fields is not None, f"{where}: {template!r} is not `key=value ...`"
    assert fields[0][0] == "event", f"{where}: the first field names the event"
    specifiers = sum(value.count("%") - 2 * value.count("%%") for _, value in fields)
    assert specifiers == arguments, where


def logfmt_fields(line: str) -> list[str]:
    """A logfmt line's `key=value` tokens, read by shlex as a logfmt reader: double quotes with
    backslash escapes, nothing else special (no single quotes, no comments)."""
    lexer: Any = shlex.shlex(line, posix=True)
    lexer.whitespace_split, lexer.commenters, lexer.quotes = True, "", '"'
    return list(lexer)


def record(template: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("inside")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    return logging.LogRecord("governor.x", logging.WARNING, __file__, 1, template, args, exc_info)


def test_a_value_with_spaces_or_quotes_stays_one_field() -> None:
    line = LogfmtFormatter("governor").format(
        record("event=worker_exited code=%d cause=%s peer=%s", 2, "--model 'x': no such directory", "a=b")
    )
    fields = dict(part.split("=", 1) for part in logfmt_fields(line))
    assert fields["proc"] == "governor" and fields["level"] == "WARNING" and fields["event"] == "worker_exited"
    assert fields["code"] == "2" and fields["cause"] == "--model 'x': no such directory" and fields["peer"] == "a=b"
    assert fields["ts"].endswith("Z")


def test_the_same_record_as_json_keeps_numbers_and_the_traceback() -> None:
    line = JsonFormatter("worker").format(record("event=x n=%d ratio=%.2f what=%r", 3, 0.456, "a b", exc=True))
    event = orjson.loads(line)
    assert (event["proc"], event["event"], event["n"]) == ("worker", "x", 3)
    assert (event["ratio"], event["what"]) == ("0.46", "a b")
    assert "ValueError: inside" in event["exc"] and "\n" not in line


def test_a_line_that_is_not_a_template_is_kept_whole_as_msg() -> None:
    line = LogfmtFormatter("governor").format(record("plain words, %s of them", 3))
    assert 'msg="plain words, 3 of them"' in line


@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")))
def test_any_value_reads_back_as_written_and_stays_on_one_line(value: str) -> None:
    written = logfmt_value(value)
    assert "\n" not in written and "\r" not in written
    if "\n" not in value and "\r" not in value:
        assert logfmt_fields(f"k={written} next=1") == [f"k={value}", "next=1"]


def test_a_peer_is_one_token() -> None:
    assert peer_text(("127.0.0.1", 52744)) == "127.0.0.1:52744"
    assert peer_text(("::1", 7070, 0, 0)) == "[::1]:7070"
    assert peer_text(None) == "-" and peer_text("/tmp/s.sock") == "/tmp/s.sock"
