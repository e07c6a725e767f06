"""Compiling the worker's C kernels for the machine at hand, once, into a cache keyed by content.

Like torch's cpp_extension and Triton, a kernel is built where it runs (`-march=native`: the CPU's
own vector instructions) the first time it is needed, then reused. The key covers the source, the
compiler and its flags and this CPU's feature flags, so a cache shared between machines (a home
directory on NFS, an image layer) never hands one CPU a binary built for another. The library is
written under a temporary name and renamed into place, so workers starting together never load a
half-written file. Without a compiler the caller falls back to pure torch (see attention.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("worker.kernels")
T = TypeVar("T")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
COMPILE_TIMEOUT_S = 120
CACHE_ENV = "GOVERNOR_KERNEL_CACHE"


class KernelUnavailable(Exception):
    """A kernel cannot be built or loaded here (no compiler, a failed build, an unwritable cache)."""


def build_or_none(source: Path, bind: Callable[[Path], T], fallback: str | None) -> T | None:
    """`bind` over the library built from `source`, or None where it cannot be built or loaded here,
    logged as `event=kernel_unavailable` with what runs instead (`fallback`; None: nothing, the
    caller refuses what needs it)."""
    try:
        return bind(build(source))
    except (KernelUnavailable, OSError) as exc:
        instead = f" fallback={fallback}" if fallback else ""
        log.warning("event=kernel_unavailable kernel=%s%s reason=%r", source.stem, instead, str(exc))
        return None


def build(source: Path, target: tuple[str, ...] = ()) -> Path:
    """The shared library compiled from `source` for this machine: from the cache, or built now.
    `target`: flags after -march=native that take features away (`-mno-avx512f`), so a test can
    build, and run here, the code a CPU with fewer features gets."""
    compiler = _compiler()
    flags = (*FLAGS, *target)
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what it may #include "..."
    key = _key(source.read_bytes(), headers, compiler, flags)
    cached = _cache_dir() / f"{source.stem}-{key}.so"
    if cached.exists():
        return cached
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(partial)],
            check=True,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        os.replace(partial, cached)
    except subprocess.CalledProcessError as exc:
        raise KernelUnavailable(f"{compiler} failed on {source.name}: {exc.stderr.strip()[-500:]}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"cannot build {source.name} with {compiler}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return cached


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and (path := shutil.which(candidate)):
            return path
    raise KernelUnavailable("no C compiler found (set CC, or install gcc)")


def _key(source: bytes, headers: list[bytes], compiler: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(source)
    for header in headers:
        digest.update(b"\0" + header)
    for part in (compiler, *flags, _compiler_version(compiler), _cpu_flags()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:20]


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"cannot run {compiler}: {exc}") from None


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for); empty where /proc is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    """$GOVERNOR_KERNEL_CACHE, else ~/.cache/governor/kernels; a private temporary directory (so no
    other user can plant a library) when neither can be used."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        path = Path(configured)
    else:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        path = Path(cache_home) / "governor" / "kernels"
    try:
        if path.is_absolute():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="governor-kernels-"))
