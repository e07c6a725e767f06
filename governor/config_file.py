"""`--config PATH`: GovernorConfig values from a TOML file, re-read on SIGHUP.

Top-level keys are the flags' names (`max_inflight` or `max-inflight`); each `[[endpoint]]` table
is one worker: `address` plus its soft caps (`concurrency`, `qps`, `burst`, `weight`), the same
as a `--worker` value. Flags given on the command line win over the file.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from governor.config import ConfigError, GovernorConfig

_ENDPOINT_KEYS = ("concurrency", "qps", "burst", "weight")
_NOT_IN_FILE = {"config", "worker_args", "flag_overrides", "worker"}


def load_config(flags: dict[str, Any], worker_args: tuple[str, ...] = ()) -> GovernorConfig:
    """The configuration from the flags given, over the config file they name, over the defaults."""
    base = read_config_file(flags["config"]) if flags.get("config") else {}
    return GovernorConfig(**{**base, **flags, "worker_args": worker_args, "flag_overrides": tuple(flags)})


def reload_config(config: GovernorConfig) -> GovernorConfig:
    """`config` with its file read again (SIGHUP); the flags it was started with still win."""
    flags = {name: getattr(config, name) for name in config.flag_overrides}
    return load_config(flags, config.worker_args)


def read_config_file(path: str) -> dict[str, Any]:
    """The file's values as GovernorConfig field values; ConfigError names whatever is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    hints = typing.get_type_hints(GovernorConfig)
    fields = {f.name for f in dataclasses.fields(GovernorConfig)} - _NOT_IN_FILE
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "endpoint":
            values["worker"] = tuple(_endpoint_spec(path, i, table) for i, table in enumerate(_tables(path, value)))
            continue
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        values[name] = _checked(path, key, value, hints[name])
    return values


def _tables(path: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"--config {path}: 'endpoint' must be an array of tables ([[endpoint]])")
    return value


def _endpoint_spec(path: str, index: int, table: dict[str, Any]) -> str:
    """The table as a `--worker` value, so both forms go through one parser."""
    unknown = set(table) - {"address", *_ENDPOINT_KEYS}
    if unknown or not isinstance(table.get("address"), str):
        raise ConfigError(f"--config {path}: endpoint {index + 1} needs a string 'address' and only {_ENDPOINT_KEYS}")
    caps = [f"{key}={table[key]}" for key in _ENDPOINT_KEYS if key in table]
    return ",".join([table["address"], *caps])


def _checked(path: str, key: str, value: Any, kind: Any) -> Any:
    if typing.get_origin(kind) is Literal:
        ok = value in typing.get_args(kind)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"--config {path}: {key} = {value!r} is not a valid {getattr(kind, '__name__', kind)}")
    return float(value) if kind is float else value
