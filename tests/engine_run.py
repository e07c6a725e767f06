"""Driving an `LLMEngine` in tests: requests, a set of prompts, stepping until idle."""

from __future__ import annotations

from typing import Any

from govwire.request import GenerateRequest
from worker.engine import FinishEvent, LLMEngine, TokenEvent

PROMPTS = [
    ("a", "The quick brown fox", 30),
    ("b", "Governors keep", 7),
    ("c", "naïve café, Straße, 日本語 " * 3, 25),
    ("d", "x", 40),
    ("e", "Continuous batching lets requests join and leave at every step. " * 2, 12),
]


def request(rid: str, prompt: str, max_new_tokens: int, **kw: Any) -> GenerateRequest:
    return GenerateRequest(id=rid, prompt=prompt, max_new_tokens=max_new_tokens, **{"temperature": 0.0, **kw})


def drain(engine: LLMEngine, events: dict[str, list[TokenEvent | FinishEvent]] | None = None) -> dict[str, Any]:
    """Step until idle; return each request's FinishEvent (and collect every event if asked)."""
    finished: dict[str, FinishEvent] = {}
    while engine.has_work:
        for event in engine.step():
            if events is not None:
                events.setdefault(event.seq.request_id, []).append(event)
            if isinstance(event, FinishEvent):
                finished[event.seq.request_id] = event
    return finished


def run_with_late_arrivals(engine: LLMEngine, prompts: list[tuple[str, str, int]] = PROMPTS) -> dict[str, FinishEvent]:
    """Greedy: the first three prompts at once, the others while those are mid-decode."""
    finished: dict[str, FinishEvent] = {}
    for rid, prompt, n in prompts[:3]:
        engine.add(request(rid, prompt, n))
    for _ in range(4):
        finished |= {e.seq.request_id: e for e in engine.step() if isinstance(e, FinishEvent)}
    for rid, prompt, n in prompts[3:]:
        engine.add(request(rid, prompt, n))
    return finished | drain(engine)
