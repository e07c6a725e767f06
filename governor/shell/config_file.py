"""Where GovernorConfig values come from: flags > environment > config file > defaults.

- The TOML file (`--config PATH`, re-read on SIGHUP): top-level keys are the flags' names
  (`max_inflight` or `max-inflight`); each `[[endpoint]]` table is one worker: `address` plus its
  soft caps (`concurrency`, `tokens`, `qps`, `burst`, `weight`; and `model`, `api_key_file` for an
  OpenAI-compatible one), the same as a `--worker` value;
  each `[[tenant]]` table is one tenant: `name` plus its weight and caps, as a `--tenant` value.
- The environment: `GOVERNOR_` + the flag's name in capitals (`GOVERNOR_MAX_INFLIGHT=64`);
  repeatable settings take space-separated values (`GOVERNOR_WORKER="h:1,concurrency=4 h:2"`).
  Variables naming no setting are left alone (other tools share the prefix).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import orjson

from governor.admission.endpoint import OpenAITarget
from governor.admission.tenant import TENANT_KEYS, parse_tenant
from governor.shell.config import GovernorConfig
from governor.shell.endpoints import TARGET_KEYS, parse_endpoint
from govwire.options import ConfigError

_ENDPOINT_KEYS = ("concurrency", "tokens", "qps", "burst", "weight")
_FILE_ENDPOINT_KEYS = (*_ENDPOINT_KEYS, *TARGET_KEYS)
_NOT_IN_FILE = {"config", "worker_args", "flag_overrides", "worker", "tenant"}
ENV_PREFIX = "GOVERNOR_"


def config_layers(flags: dict[str, Any], environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The values each source sets, lowest precedence first: file, env, flag."""
    env = read_environment(environ)
    path = flags.get("config") or env.get("config")
    return {"file": read_config_file(path) if path else {}, "env": env, "flag": flags}


def config_sources(flags: dict[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """Which source set each setting that is not at its default."""
    return {name: source for source, layer in config_layers(flags, environ).items() for name in layer}


def load_config(
    flags: dict[str, Any], worker_args: tuple[str, ...] = (), environ: Mapping[str, str] | None = None
) -> GovernorConfig:
    """The effective configuration. What flags and the environment set is kept over a reload."""
    layers = config_layers(flags, os.environ if environ is None else environ)
    values = {name: value for layer in layers.values() for name, value in layer.items()}
    pinned = tuple({**layers["env"], **layers["flag"]})
    return GovernorConfig(**values, worker_args=worker_args, flag_overrides=pinned)


def reload_config(config: GovernorConfig) -> GovernorConfig:
    """`config` with its file read again (SIGHUP); what flags and the environment set still wins."""
    pinned = {name: getattr(config, name) for name in config.flag_overrides}
    return load_config(pinned, config.worker_args, environ={})


def read_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """`GOVERNOR_*` variables as GovernorConfig field values; ConfigError names a bad one."""
    hints = typing.get_type_hints(GovernorConfig)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GovernorConfig):
        variable = ENV_PREFIX + f.name.upper()
        if "help" not in f.metadata or variable not in environ:
            continue
        text, kind = environ[variable], hints[f.name]
        if not text.strip():
            # `VAR=${UNSET}` in a compose file: refusing it beats silently dropping auth or endpoints
            raise ConfigError(f"${variable} is empty; unset it or give it a value")
        if typing.get_origin(kind) is tuple:
            values[f.name] = tuple(text.split())
            continue
        try:
            value: Any = kind(text) if kind in (int, float) else text
            if kind is bool:
                value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[text.lower()]
        except KeyError:
            raise ConfigError(f"${variable}: {text!r} is not a boolean (true or false)") from None
        except ValueError:
            raise ConfigError(f"${variable}: {text!r} is not a valid {kind.__name__}") from None
        values[f.name] = _checked(f"${variable}", f.name, value, kind)
    return values


def render_config(config: GovernorConfig, sources: dict[str, str]) -> str:
    """The effective configuration as a config file (`--print-config`), each line marked with
    where its value came from. Token files are shown by path; tokens never."""
    lines = ["# governor serve: effective configuration (flag > env > file > default)"]
    if config.config:
        lines.append(f"# config file: {config.config}")
    endpoints: list[str] = []
    for f in dataclasses.fields(config):
        if "help" not in f.metadata or f.name == "config":
            continue
        value = getattr(config, f.name)
        source = sources.get(f.name, "default")
        if f.name == "worker":
            for spec in value:
                address, limits = parse_endpoint(spec)
                caps = "".join(f"\n{key} = {getattr(limits, key)!r}" for key in _ENDPOINT_KEYS)
                if isinstance(address, OpenAITarget):
                    caps += f"\nmodel = {address.model!r}"
                    caps += f"\napi_key_file = {address.api_key_file!r}" if address.api_key_file else ""
                    caps += f"\nserved_as = {address.served_as!r}" if address.served_as else ""
                    caps += f"\nignore_eos = {address.ignore_eos!r}" if address.ignore_eos != "pass" else ""
                    caps += "" if address.probe else "\nprobe = 'off'"
                endpoints.append(f"[[endpoint]]  # {source}\naddress = {str(address)!r}{caps}")
            continue
        if f.name == "tenant":
            for spec in value:
                name, tenant_limits = parse_tenant(spec)
                caps = "".join(f"\n{key} = {getattr(tenant_limits, key)!r}" for key in TENANT_KEYS)
                endpoints.append(f"[[tenant]]  # {source}\nname = {name!r}{caps}")
            continue
        # TOML: strings and arrays as JSON writes them, booleans lower-case, numbers as Python does
        if isinstance(value, str | tuple | bool):
            shown = orjson.dumps(list(value) if isinstance(value, tuple) else value).decode()
        else:
            shown = repr(value)
        lines.append(f"{f.name} = {shown}  # {source}")
    if config.worker_args:
        lines.append(f"# spawned worker flags (after --): {' '.join(config.worker_args)}")
    return "\n".join([*lines, *endpoints]) + "\n"


def read_config_file(path: str) -> dict[str, Any]:
    """The file's values as GovernorConfig field values; ConfigError names whatever is wrong."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    hints = typing.get_type_hints(GovernorConfig)
    fields = {f.name for f in dataclasses.fields(GovernorConfig)} - _NOT_IN_FILE
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "endpoint":
            values["worker"] = tuple(
                _table_spec(path, "endpoint", "address", _FILE_ENDPOINT_KEYS, i, table)
                for i, table in enumerate(_tables(path, key, value))
            )
            continue
        if key == "tenant":
            values["tenant"] = tuple(
                _table_spec(path, "tenant", "name", TENANT_KEYS, i, table)
                for i, table in enumerate(_tables(path, key, value))
            )
            continue
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        values[name] = _checked(f"--config {path}", key, value, hints[name])
    return values


def _tables(path: str, key: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"--config {path}: {key!r} must be an array of tables ([[{key}]])")
    return value


def _table_spec(path: str, kind: str, head: str, keys: tuple[str, ...], index: int, table: dict[str, Any]) -> str:
    """The table as a flag value (`--worker` for an endpoint, `--tenant` for a tenant), so both
    forms go through one parser."""
    unknown = set(table) - {head, *keys}
    if unknown or not isinstance(table.get(head), str):
        raise ConfigError(f"--config {path}: {kind} {index + 1} needs a string {head!r} and only {keys}")
    caps = [f"{key}={table[key]}" for key in keys if key in table]
    return ",".join([table[head], *caps])


def _checked(where: str, key: str, value: Any, kind: Any) -> Any:
    if typing.get_origin(kind) is tuple:  # a repeatable flag: an array of strings
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        value = tuple(value) if ok else value
    elif typing.get_origin(kind) is Literal:
        ok = value in typing.get_args(kind)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else ()
        expected = " or ".join(map(repr, choices)) or kind.__name__
        raise ConfigError(f"{where}: {key} = {value!r} is not a valid value; expected {expected}")
    return float(value) if kind is float else value
