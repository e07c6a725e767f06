"""One line per event to stderr, as logfmt (`key=value`, the default) or JSON; quiet unless
something happens.

Every log call of the governor and the worker is written as a logfmt template of `key=%s` pairs
(`log.info("event=worker_spawned pid=%d", pid)`), so its fields are known without parsing what it
printed: the formatter splits the *template* (our own code, never peer input) into keys and value
formats, and formats each argument into its own value. Values are then quoted where logfmt needs it
(a space, a quote, an `=`), so a value can never run into the next field, and the same record
renders as a JSON object with `--log-format json`. A record that is not such a template (a
library's) keeps its text whole, as `msg`. tests/unit/test_logs.py checks every call's template.
"""

from __future__ import annotations

import datetime
import logging
import re
import sys
from typing import Any, Literal, get_args

import orjson

LogFormat = Literal["logfmt", "json"]  # both programs' --log-format
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)

# One `key=value` token of a template: the value either literal or made of %-specifiers.
_TOKEN = re.compile(r"[a-z_][a-z0-9_.]*=\S*")
_SPEC = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?([sdrfgxi])")
_NEEDS_QUOTES = re.compile(r'[\s"=\\]')
_JSON_SCALARS = (str, int, float, bool, type(None))


def template_fields(template: str) -> list[tuple[str, str]] | None:
    """The (key, value format) pairs of a logfmt template, or None when it is not one."""
    tokens = template.split(" ")
    if not all(_TOKEN.fullmatch(token) for token in tokens):
        return None
    return [(key, value) for key, _, value in (token.partition("=") for token in tokens)]


def _fields(record: logging.LogRecord) -> dict[str, Any] | None:
    """The record's message as fields, each argument formatted into its own value (JSON scalars
    kept as they are where the format is plain `%s`/`%d`), or None when it is not a template."""
    template = record.msg
    if not isinstance(template, str):
        return None
    pairs = template_fields(template)
    if pairs is None:
        return None
    args = record.args if isinstance(record.args, tuple) else (record.args,) if record.args else ()
    fields: dict[str, Any] = {}
    at = 0
    for key, value in pairs:
        specs = _SPEC.findall(value)
        if not specs:
            fields[key] = value.replace("%%", "%") if args else value
            continue
        taken = args[at : at + len(specs)]
        at += len(specs)
        if len(taken) < len(specs):
            return None  # fewer arguments than specifiers: let logging say so its own way
        if value in ("%s", "%d", "%r") and isinstance(taken[0], _JSON_SCALARS):
            fields[key] = taken[0]
            continue
        # %r was asked for a string's quotes, which logfmt's own quoting now gives where needed
        fields[key] = _SPEC.sub(_r_as_s, value) % taken
    return fields if at == len(args) else None


def _r_as_s(match: re.Match[str]) -> str:
    spec = match.group(0)
    return spec[:-1] + "s" if match.group(1) == "r" else spec


def logfmt_value(value: Any) -> str:
    """A value as logfmt writes it: bare when it can be, else double-quoted with `\\` escapes (a
    newline becomes `\\n`: one event, one line)."""
    text = "null" if value is None else ("true" if value is True else "false" if value is False else str(value))
    if text and not _NEEDS_QUOTES.search(text):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


class _Formatter(logging.Formatter):
    def __init__(self, proc: str) -> None:
        super().__init__()
        self.proc = proc

    def head(self, record: logging.LogRecord) -> dict[str, Any]:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        return {
            "ts": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(record.msecs):03d}Z",
            "level": record.levelname,
            "proc": self.proc,
            "logger": record.name,
        }

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        return _fields(record) or {"msg": record.getMessage()}


class LogfmtFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = {**self.head(record), **self.fields(record)}
        line = " ".join(f"{key}={logfmt_value(value)}" for key, value in parts.items())
        if record.exc_info:  # a traceback stays readable, on the lines after its event
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = {**self.head(record), **self.fields(record)}
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(event, default=str).decode()


def configure_logging(level: str, name: str, log_format: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(name) if log_format == "json" else LogfmtFormatter(name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx (the OpenAI-compatible upstreams) logs every request at INFO: one line per request
    # is not an event. Its warnings still show.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
