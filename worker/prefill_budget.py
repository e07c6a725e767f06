"""How many prompt tokens a step may carry beside running streams: a budget that follows the batch.

A fixed budget is wrong at both ends. While nothing decodes, a small one only stretches a burst
of prompts over many steps (32 prompts took 81 steps where 64 would do, 15 of them with a handful
of decode rows); while streams run, a large one stalls every one of them for as long as the
prompt takes. So the scheduler takes its whole cap (`--max-prefill-tokens`) while nothing
decodes, and beside decoding streams as many prompt tokens as keep a step within `STRETCH` times
a decode-only step: (STRETCH - 1) * d / c, where d is what a decode-only step of the current batch
takes and c what a prompt token adds, never below `FLOOR`. Both are learned from the engine's own
steps (moving averages), since they follow the model, the dtype, the batch and the machine: d
from steps without prompt tokens, by batch size (in power-of-two buckets), c from steps with
them, less the decode-only step of their batch (or, for prompt tokens alone, of the smallest
batch). No torch.

The floor is 64, not lower: with a few streams decoding, a decode step is cheap and the stretch
rule alone allows a handful of prompt tokens, so a burst that arrives over a few milliseconds
(through the front door, requests reach the worker one by one) trickles in while the batch
stays small. With a floor of 16 the served uniform workload ran 12% slower than under the fixed
64 (GPT-2 small, bf16, 2 cores: docs/benchmarks/sittings.md 5). For the same reason, until both
costs are measured (a burst keeps every step busy with prompts, so no decode-only step comes), a
step takes the whole cap: starting at the floor instead, 256 streams arriving through the front
door took two prompts a step and the served round ran at 0.7x of the fixed budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRETCH = 1.8  # a step beside streams takes at most this many decode-only steps' time
FLOOR = 64  # prompt tokens a step may always carry (the CPU's former fixed budget); see below
WEIGHT = 0.2  # of the newest step in the moving averages


@dataclass
class PrefillBudget:
    cap: int  # --max-prefill-tokens: a step's prompt tokens, at most
    # A decode-only step's time by batch size, in buckets of powers of two (1, 2-3, 4-7, ...): a
    # batch that shrinks or grows is not costed at another batch's step.
    decode_s: dict[int, float] = field(default_factory=dict)
    token_s: float | None = None  # what a prompt token adds to a step

    def observe(self, seconds: float, decode_rows: int, prompt_tokens: int) -> None:
        """A step took `seconds` with these rows."""
        if seconds <= 0:
            return
        if not prompt_tokens:
            if decode_rows:
                bucket = _bucket(decode_rows)
                self.decode_s[bucket] = _average(self.decode_s.get(bucket), seconds)
            return
        # The step's cost without its prompt: a decode-only step of its batch, or, for a step of
        # prompt tokens alone, the smallest batch's (the fixed cost of a step). Unknown: no sample.
        base = self._decode_step(max(decode_rows, 1))
        if base is None:
            return
        added = (seconds - base) / prompt_tokens
        if added > 0:
            self.token_s = _average(self.token_s, added)

    def while_decoding(self, decode_rows: int) -> int:
        """Prompt tokens for a step that also decodes `decode_rows` sequences."""
        decode_s = self._decode_step(decode_rows)
        if decode_s is None or self.token_s is None:
            return self.cap  # nothing to go by yet: the whole budget, as while nothing decodes
        return max(min(FLOOR, self.cap), min(self.cap, int((STRETCH - 1) * decode_s / self.token_s)))

    def _decode_step(self, decode_rows: int) -> float | None:
        """A decode-only step of this batch: its bucket's, else the nearest measured bucket's."""
        if not self.decode_s:
            return None
        bucket = _bucket(decode_rows)
        nearest = min(self.decode_s, key=lambda b: abs(b - bucket))
        return self.decode_s[nearest]


def _bucket(rows: int) -> int:
    return max(rows, 1).bit_length()


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
