"""docs/operations.md documents every flag and every metric the code has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from governor.fleet.lease import FleetLease, FleetPolicy
from governor.fleet.member import FleetMember
from governor.links.upstream import Upstream
from governor.report.metrics import build_registry
from governor.shell.cli import build_parser as governor_parser
from govwire.messages import STATS_FIELDS
from tests.fakes import make_state
from worker.cli import build_parser as worker_parser

OPERATIONS = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


def flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return {
        option
        for action in sub.choices[command]._actions  # noqa: SLF001
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def test_every_flag_of_every_command_is_documented() -> None:
    # A boolean flag's --x / --no-x pair counts as documented when either form is.
    documented = {flag.replace("--no-", "--") for flag in re.findall(r"`(--[a-z0-9-]+)", OPERATIONS)}
    commands = [(governor_parser(), c) for c in ("serve", "status", "send", "bench")] + [(worker_parser(), "serve")]
    for parser, command in commands:
        missing = {flag.replace("--no-", "--") for flag in flags(parser, command)} - documented
        assert not missing, f"{command}: {sorted(missing)} not in docs/operations.md"


def test_every_exported_metric_is_documented() -> None:
    from prometheus_client import generate_latest

    state = make_state()
    lease = FleetLease(FleetPolicy(max_inflight=8, max_qps=10.0), state.admission.hints, 0.0)
    state.fleet = FleetMember("redis://127.0.0.1:1/0", "docs", lease)  # never connects: metrics only read it
    text = generate_latest(build_registry(state, Upstream([]))).decode()
    names = {f.name for f in text_string_to_metric_families(text) if f.name.startswith("governor_")}
    names |= {f"governor_worker_{key.removesuffix('_total')}" for key in STATS_FIELDS}
    # In the Metrics section's table, where an operator looks a metric up (not only in prose).
    table = OPERATIONS.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `governor_")]
    documented = {name for cell in first_cells for name in re.findall(r"`(governor_[a-z_]+)", cell)}
    documented |= {name.removesuffix("_total") for name in documented}
    documented |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in documented}
    missing = names - documented
    assert not missing, f"{sorted(missing)} not in docs/operations.md"


def test_the_table_of_contents_lists_every_section() -> None:
    toc, _, body = OPERATIONS.partition("\n## ")
    anchors = set(re.findall(r"\]\(#([a-z0-9-]+)\)", toc))
    for heading in re.findall(r"^##+ (.+)$", "## " + body, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        assert anchor in anchors, f"docs/operations.md: {heading!r} is not in the table of contents"
