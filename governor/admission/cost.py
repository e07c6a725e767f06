"""What a generate frame costs, read off the frame before it is admitted, and what it really cost.

The cost of a request is counted in tokens: its prompt tokens plus `output_weight` times the
tokens it may generate (`max_new_tokens`), the two things that occupy an engine. The governor has
no tokenizer in its read path, so the prompt's tokens are the count the client declares
(`prompt_tokens`, a claim) or an estimate from the prompt's UTF-8 bytes at a ratio calibrated
from the counts the workers report. Either way the request is charged that estimate at admission
and settled with the real counts at its end (`settle`): an early end-of-sequence returns its
unused tokens, and a claim that was too low is charged the truth.

Reading the frame here is tolerant (a field of the wrong type counts as absent): the frame's
fields are checked only once it is admitted, so a yield still says nothing about its validity.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from governor.admission.priority import STANDARD_RANK
from governor.latency import Histogram
from govwire.request import DEFAULT_MAX_NEW_TOKENS, MAX_DEADLINE_MS
from govwire.vocab import Priority

if TYPE_CHECKING:
    from governor.admission.appointments.appointment import Appointment
    from governor.admission.tenant import Tenant

_PRIORITY: dict[object, Priority] = {p.value: p for p in Priority}
_STANDARD = Priority.STANDARD

CALIBRATION_WEIGHT = 0.05
"""Weight of the newest request in the decayed byte and token sums that give the ratio."""

ESTIMATE_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
"""Buckets of (estimated or declared prompt tokens) / (real prompt tokens)."""

ESTIMATE_SOURCES = ("declared", "estimated")


class Ask:
    """What one generate frame asks of admission: its cost, deadline, class and tenant. Built for
    every generate frame, so a plain slotted class (a dataclass would cost more per frame than the
    fields are worth)."""

    __slots__ = (
        "prompt_bytes",
        "prompt_tokens",
        "declared",
        "max_new_tokens",
        "cost",
        "deadline_s",
        "priority",
        "tenant",
        "ceiling",
        "ticket",
        "resent",
        "identity",
        "identity_unique",
        "appointment",
        "rank",
        "retry",
        "to_length",
    )

    def __init__(
        self,
        prompt_bytes: int = 0,
        prompt_tokens: int = 0,
        declared: bool = False,
        max_new_tokens: int = 0,
        cost: int = 0,
        deadline_s: float | None = None,
        priority: Priority = _STANDARD,
        tenant: Tenant | None = None,
    ) -> None:
        self.prompt_bytes = prompt_bytes
        self.prompt_tokens = prompt_tokens  # declared, or estimated from prompt_bytes
        self.declared = declared
        self.max_new_tokens = max_new_tokens
        self.cost = cost  # what admission reserves: prompt_tokens + output_weight * max_new_tokens
        self.deadline_s = deadline_s  # time to first token the client waits for; None = no deadline
        # It runs to `max_new_tokens`: its length is known, not forecast (release_forecast.py).
        # A frame's ask (`CostModel.ask`) says so only for `stop_on_eos: false` (`ignore_eos`);
        # an ask made otherwise is taken at its length.
        self.to_length = True
        self.priority = priority
        self.tenant = tenant  # set by the ingress (who the connection or frame acts as); None = nobody's
        # The fraction of each cap this request may fill: its class's ceiling, set by admission.
        self.ceiling = 1.0
        # What recognises a client returning to an appointment (appointments.py): the ticket its
        # retry sent back, and what it re-sends when it retries without one (`resent`, the door's
        # choice: an NDJSON frame's id and prompt, an HTTP body), whose digest admission takes
        # while appointments are live (`identity`; 0 = none), `identity_unique` when no other
        # client can send the same (it names the client's own request id); the appointment they
        # name, found by admission.
        self.ticket: str | None = None
        self.resent: object = None
        self.identity = 0
        self.identity_unique = False
        self.appointment: Appointment | None = None
        # Where it stands among the appointments (appointments.py): its class, then whether its
        # tenant is at or below its fair share (set by admission; standard, at its share: 3).
        self.rank = STANDARD_RANK
        # The client says this is a retry (x-stainless-retry-count > 0, a retry ticket): one
        # without a valid appointment (`appointment` None once decided) is a blind retry.
        self.retry = False

    def __repr__(self) -> str:
        tenant = None if self.tenant is None else self.tenant.name
        return f"Ask(cost={self.cost}, deadline_s={self.deadline_s}, {self.priority.value}, tenant={tenant})"


NO_ASK = Ask()
"""A standard request that costs nothing, has no deadline and no tenant (tests and callers
without token limits). Admission never changes it: it decides on a copy."""


class CostModel:
    """Turns frames into `Ask`s and settles them; keeps the bytes-per-token ratio and the
    estimates' accuracy."""

    __slots__ = ("bytes_per_token", "output_weight", "calibrate", "_max_new_tokens", "_bytes", "_tokens", "accuracy")

    def __init__(
        self, bytes_per_token: float, output_weight: float, max_new_tokens_limit: int, calibrate: bool = True
    ) -> None:
        if not (bytes_per_token > 0 and output_weight >= 0 and max_new_tokens_limit >= 1):
            raise ValueError("cost model: bytes_per_token > 0, output_weight >= 0, max_new_tokens_limit >= 1")
        self.bytes_per_token = bytes_per_token
        self.output_weight = output_weight
        self.calibrate = calibrate
        self._max_new_tokens = max_new_tokens_limit
        # Decayed sums of prompt bytes and real prompt tokens: their ratio is bytes_per_token.
        self._bytes = 0.0
        self._tokens = 0.0
        self.accuracy = {source: Histogram(ESTIMATE_RATIO_BUCKETS) for source in ESTIMATE_SOURCES}

    def ask(self, obj: dict[str, Any]) -> Ask:
        """The frame's cost and deadline, before any of its fields is validated."""
        prompt = obj.get("prompt")
        if type(prompt) is str:
            # isascii() is O(1) on CPython's compact strings: the encode runs only for non-ASCII text
            prompt_bytes = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8", "replace"))
        else:
            prompt_bytes = 0
        declared = obj.get("prompt_tokens")
        if type(declared) is int and declared >= 0:
            prompt_tokens, is_declared = declared, True
        else:
            prompt_tokens, is_declared = math.ceil(prompt_bytes / self.bytes_per_token), False
        n = obj.get("max_new_tokens")
        if not (type(n) is int and 1 <= n <= self._max_new_tokens):
            n = min(DEFAULT_MAX_NEW_TOKENS, self._max_new_tokens)
        deadline = obj.get("deadline_ms")
        deadline_s = (
            deadline / 1000.0
            if (type(deadline) is int or type(deadline) is float) and 0 < deadline <= MAX_DEADLINE_MS
            else None
        )
        cost = prompt_tokens + math.ceil(self.output_weight * n)
        claimed = obj.get("priority")
        priority = _PRIORITY.get(claimed, _STANDARD) if type(claimed) is str else _STANDARD
        ask = Ask(prompt_bytes, prompt_tokens, is_declared, n, cost, deadline_s, priority)
        ask.to_length = obj.get("stop_on_eos") is False
        return ask

    def cost_of(self, prompt_tokens: int, completion_tokens: int) -> int:
        """What a request with these real counts cost, on the scale of `Ask.cost`."""
        return prompt_tokens + math.ceil(self.output_weight * completion_tokens)

    def settle(self, ask: Ask, prompt_tokens: int, completion_tokens: int) -> int:
        """A request ended with a `done` carrying its real counts: learn from them, and return its
        real cost."""
        if prompt_tokens > 0:
            source = "declared" if ask.declared else "estimated"
            self.accuracy[source].observe(ask.prompt_tokens / prompt_tokens)
            if self.calibrate and ask.prompt_bytes > 0:
                self._bytes += CALIBRATION_WEIGHT * (ask.prompt_bytes - self._bytes)
                self._tokens += CALIBRATION_WEIGHT * (prompt_tokens - self._tokens)
                self.bytes_per_token = self._bytes / self._tokens
        return self.cost_of(prompt_tokens, completion_tokens)
