"""The command line's own helpers (the commands themselves run in tests/integration)."""

from __future__ import annotations

from governor.cli import printable


def test_send_escapes_control_characters_but_keeps_text_newlines_and_tabs() -> None:
    assert printable("a\x07b\x1b[2Jc\x85") == "a\\x07b\\x1b[2Jc\\x85"
    assert printable("line\n\tnext ünïcode ✓") == "line\n\tnext ünïcode ✓"
