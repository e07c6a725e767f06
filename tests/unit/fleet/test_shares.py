"""This replica's share of a fleet limit (governor/fleet/shares.py), on its own: what it measures
of the demand that waits on it."""

from __future__ import annotations

import pytest

from governor.fleet.shares import WaitLedger


def test_the_wait_ledger_counts_each_client_until_its_hint_ends() -> None:
    """Two clients told to wait 600 ms and one 100 ms, at t=10 s: over the periods of 250 ms that
    follow, 2 + 1 wait, then 2, then 2 for 100 ms of the 250; then nobody, at once."""
    ledger = WaitLedger(30.0)
    ledger.take_area(10.0)
    ledger.add(10.0, 2, 0.6)
    ledger.add(10.0, 1, 0.1)
    periods = [ledger.take_area(10.0 + 0.25 * k) / 0.25 for k in range(1, 5)]
    assert periods == pytest.approx([2 + 1 * 0.1 / 0.25, 2.0, 2 * 0.1 / 0.25, 0.0], abs=0.05)
