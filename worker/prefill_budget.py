"""How many prompt tokens a step may carry beside running streams: a budget that follows the batch.

A fixed budget is wrong at both ends. While nothing decodes, a small one only stretches a burst
of prompts over many steps (32 prompts took 81 steps where 64 would do, 15 of them with a handful
of decode rows); while streams run, a large one stalls every one of them for as long as the
prompt takes. So the scheduler takes its whole cap (`--max-prefill-tokens`) while nothing
decodes, and beside decoding streams as many prompt tokens as keep a step within `STRETCH` times
a decode-only step: (STRETCH - 1) * d / c, where d is what a decode-only step of the current batch
takes and c what a prompt token adds, never below `FLOOR`. Both are learned from the engine's own
steps (moving averages), since they follow the model, the dtype, the batch and the machine: d
from steps without prompt tokens, c from steps with them, less d. No torch.

The floor is 64, not lower: with a few streams decoding, a decode step is cheap and the stretch
rule alone allows a handful of prompt tokens, so a burst that arrives over a few milliseconds
(through the front door, requests reach the worker one by one) trickles in while the batch
stays small. With a floor of 16 the served uniform workload ran 12% slower than under the fixed
64 (GPT-2 small, bf16, 2 cores: docs/benchmarks/sittings.md 5).
"""

from __future__ import annotations

from dataclasses import dataclass

STRETCH = 1.8  # a step beside streams takes at most this many decode-only steps' time
FLOOR = 64  # prompt tokens a step may always carry (the CPU's former fixed budget); see below
INITIAL = FLOOR  # beside streams, until both costs are measured
WEIGHT = 0.2  # of the newest step in the moving averages


@dataclass
class PrefillBudget:
    cap: int  # --max-prefill-tokens: a step's prompt tokens, at most
    decode_s: float | None = None  # a decode-only step of the recent batch
    token_s: float | None = None  # what a prompt token adds to a step

    def observe(self, seconds: float, decode_rows: int, prompt_tokens: int) -> None:
        """A step took `seconds` with these rows."""
        if seconds <= 0:
            return
        if not prompt_tokens:
            if decode_rows:
                self.decode_s = _average(self.decode_s, seconds)
            return
        base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        if decode_rows and self.decode_s is None:
            return  # no decode-only step yet: the prompt's share cannot be told apart
        added = (seconds - base) / prompt_tokens
        if added > 0:
            self.token_s = _average(self.token_s, added)

    @property
    def while_decoding(self) -> int:
        """Prompt tokens for a step that also decodes."""
        if self.decode_s is None or self.token_s is None:
            return min(self.cap, INITIAL)
        return max(min(FLOOR, self.cap), min(self.cap, int((STRETCH - 1) * self.decode_s / self.token_s)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
