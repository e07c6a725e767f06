"""Every `--help` a user can type: each console script, each of its subcommands, and `--version`.

The first command many users type is `governor serve --help`; a `%` in one option's help once
made argparse crash on it. The scripts are read from pyproject.toml, so a new one is covered."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _entry(target: str) -> tuple[Callable[[list[str]], int], argparse.ArgumentParser]:
    """The script's `main` and the parser its module builds (`build_parser`, beside `main`)."""
    module_name, _, func = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, func), module.build_parser()


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command path of a parser: () and each subcommand, recursively."""
    yield prefix
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))


CASES = [(script, path) for script, target in SCRIPTS.items() for path in _commands(_entry(target)[1])]


def test_every_console_script_has_subcommands_to_check() -> None:
    assert {"governor", "worker"} <= set(SCRIPTS)
    assert ("governor", ("serve",)) in CASES and ("worker", ("serve",)) in CASES


@pytest.mark.parametrize(("script", "path"), CASES, ids=[" ".join((s, *p)) for s, p in CASES])
def test_help_prints_usage_and_exits_zero(
    script: str, path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    main, _ = _entry(SCRIPTS[script])
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: " + " ".join((script, *path)))
    # Every option's help is there, each with its default.
    assert "--help" in out


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_version_names_the_program_and_the_release(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    from govwire import __version__

    main, _ = _entry(SCRIPTS[script])
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.split()[:2] == [script, __version__]


def test_a_percent_sign_in_an_options_help_is_printed_as_written() -> None:
    from dataclasses import dataclass

    from govwire.options import add_options, option

    @dataclass(frozen=True)
    class Config:
        share: float = option(0.05, "5% of first tokens may come later (100%% sure)")

    parser = argparse.ArgumentParser(prog="x")
    add_options(parser, Config)
    assert "5% of first tokens may come later (100%% sure) (default: 0.05)" in " ".join(parser.format_help().split())


def test_an_invalid_setting_is_reported_by_the_subcommand_it_belongs_to(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    main, _ = _entry(SCRIPTS["governor"])
    monkeypatch.setenv("GOVERNOR_MAX_INFLIGHT", "abc")
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: governor serve")
    assert "governor serve: error: $GOVERNOR_MAX_INFLIGHT: 'abc' is not a valid int" in err
