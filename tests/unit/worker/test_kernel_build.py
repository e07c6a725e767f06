"""Building the C kernels: cached by content, rebuilt when the source changes, typed failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.kernels import build as kernel_build
from worker.kernels.build import KernelUnavailable, build, build_or_none

SOURCE = "int answer(void) { return 42; }\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv(kernel_build.CACHE_ENV, str(path))
    return path


def test_a_build_is_cached_and_reused_until_the_source_changes(tmp_path: Path, cache: Path) -> None:
    import ctypes

    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    first = build(source)
    assert first.parent == cache and ctypes.CDLL(str(first)).answer() == 42
    built_at = first.stat().st_mtime_ns
    assert build(source) == first and first.stat().st_mtime_ns == built_at  # not compiled again
    source.write_text(SOURCE.replace("42", "43"))
    second = build(source)
    assert second != first and ctypes.CDLL(str(second)).answer() == 43
    assert not list(cache.glob("*.tmp"))  # no half-written files left behind


def test_a_source_that_does_not_compile_is_unavailable_with_the_compiler_message(tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return }\n")
    with pytest.raises(KernelUnavailable, match="broken.c"):
        build(source)
    assert not list(cache.iterdir())


def test_build_or_none_binds_a_library_or_logs_what_runs_instead(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import ctypes

    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    assert build_or_none(source, lambda path: ctypes.CDLL(str(path)).answer(), "torch") == 42
    broken = tmp_path / "broken.c"
    broken.write_text("int broken(void) { return }\n")
    with caplog.at_level("WARNING", logger="worker.kernels"):
        assert build_or_none(broken, ctypes.CDLL, "torch") is None
        assert build_or_none(broken, ctypes.CDLL, None) is None
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].startswith("event=kernel_unavailable kernel=broken fallback=torch reason=")
    assert lines[1].startswith("event=kernel_unavailable kernel=broken reason=")


def test_no_compiler_is_unavailable(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang either
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        build(source)


def test_an_unusable_cache_falls_back_to_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(kernel_build.CACHE_ENV, str(blocked / "cache"))
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    library = build(source)
    assert library.exists() and not library.is_relative_to(blocked)
    assert library.parent.stat().st_mode & 0o777 == 0o700
