"""Build argparse options from a config dataclass, so each option is declared once.

Process plumbing the governor and the worker share (with logs.py): each program's config is a
frozen dataclass whose fields are declared with `option()`, and whose checks raise `ConfigError`.

A field becomes `--field-name` when its metadata carries `help` (see `option()`); its type comes
from the annotation: int, float, str, bool (--x / --no-x), Literal[...] (choices) or
tuple[str, ...] (repeatable).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal, TypeVar, cast

T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid configuration; the message names the setting."""


def option(default: Any, help: str, *, metavar: str | None = None) -> Any:
    """A dataclass field that is also a command-line flag."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar})


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help")
        if help_text is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is tuple:
            kwargs["action"] = "append"
        else:
            kwargs["type"] = kind
        # argparse expands `%(default)s`-style specifiers in help: a literal `%` ("5% of") would
        # crash every --help, so the text is escaped here, once for every option.
        text = f"{help_text} (default: {_show(f.default)})".replace("%", "%%")
        parser.add_argument(flag, help=text, **kwargs)


def _show(value: Any) -> str:
    return "none" if value in ((), None, "") else str(value)


def given(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The field values of the flags actually given (absent flags are not in the namespace)."""
    fields = dataclasses.fields(cast(Any, cls))
    values = {f.name: getattr(namespace, f.name) for f in fields if hasattr(namespace, f.name)}
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if typing.get_origin(hints[name]) is tuple:
            values[name] = tuple(value)
    return values


def from_namespace(cls: type[T], namespace: argparse.Namespace, **extra: Any) -> T:
    """Instantiate `cls` from the flags given (absent flags keep the dataclass defaults)."""
    return cls(**given(cls, namespace), **extra)
