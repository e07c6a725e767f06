"""What one tenant's or one priority class's frames came to: the per-tenant and per-class counts.

Written only through `accounting.Accounting`'s methods (one count per event, as for the totals).
"""

from __future__ import annotations

from govwire.vocab import YieldReason


class Tally:
    """The frames of one tenant or one priority class: what was admitted, executed and yielded,
    and the real token cost of what settled. The per-tenant and per-class metrics read these."""

    __slots__ = ("admitted", "settled", "executed", "yielded", "tokens_settled")

    def __init__(self) -> None:
        self.admitted = 0
        self.settled = 0  # admitted requests that ended, whatever their outcome
        self.executed = 0
        self.yielded = {reason.value: 0 for reason in YieldReason}
        self.tokens_settled = 0

    def count_settled(self, executed: bool, used_tokens: int) -> None:
        """One of its admitted requests ended (written only through `Accounting.request_settled`)."""
        self.settled += 1
        self.executed += executed
        self.tokens_settled += used_tokens

    @property
    def inflight(self) -> int:
        return self.admitted - self.settled

    @property
    def yielded_total(self) -> int:
        return sum(self.yielded.values())
