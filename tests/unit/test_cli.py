"""The command line's own helpers (the commands themselves run in tests/integration)."""

from __future__ import annotations

from governor.client import Yielded
from governor.shell.cli import describe_yield, printable


def test_send_escapes_control_characters_but_keeps_text_newlines_and_tabs() -> None:
    assert printable("a\x07b\x1b[2Jc\x85") == "a\\x07b\\x1b[2Jc\\x85"
    assert printable("line\n\tnext ünïcode ✓") == "line\n\tnext ünïcode ✓"


def test_a_final_refusal_says_so_and_shows_no_hint_to_come_back_at() -> None:
    final = describe_yield(Yielded("1", 3219, "inflight", None, final=True))
    assert "final=true" in final and "do not retry" in final and "3219" not in final
    retry = describe_yield(Yielded("1", 375, "inflight", "t-1"))
    assert "retry_hint_ms=375" in retry and "retry_ticket=t-1" in retry and "final" not in retry
