"""One request's state inside the GPT-2 engine. No torch."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from govwire.vocab import FinishReason


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """Token ids, cache position and timings of one request.

    `num_computed` counts the tokens whose keys and values are in the cache. While its prompt is
    not all in the cache, or (after a preemption) more than one of its tokens is missing, the
    sequence is prefilling (maybe in chunks): its prompt, then the tokens it had generated;
    afterwards each step feeds the last sampled token. Compared by identity: two requests never share a sequence.

    While steps overlap (engine.py), the scheduler runs ahead of the tokens: a step that samples for
    it adds one to `num_pending` when it is scheduled, and the token joins `output_ids` (or ends
    the sequence) when that step completes. `num_computed` counts the rows scheduled into the
    cache, in flight or done; `output_ids` holds confirmed tokens only.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_on_eos: bool
    t_arrival: float
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_pending: int = 0  # tokens sampled by scheduled steps that have not completed
    slot: int = -1  # its row in the scheduler's persistent batch while admitted (scheduler.py)
    is_decoding: bool = False  # its prefill is scheduled: each step feeds one token
    block_table: list[int] = field(default_factory=list)  # KV blocks holding its tokens, in order
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks (block_manager.py)
    num_keyed_blocks: int = 0  # leading blocks of its table already offered to the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    num_admissions: int = 0  # 1 + the times it was preempted and admitted again
    last_step: int = 0  # the scheduler's last step that ran it (decode or prefill chunk)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None  # None: running, or failed
    t_admitted: float | None = None
    t_first_token: float | None = None
    t_finished: float | None = None
    rng: random.Random | None = None  # a sampled (non-greedy) request's own draws; see sampling.py

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, confirmed and pending tokens: what the scheduler plans with."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and confirmed tokens: the ids the host knows."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_kv_tokens(self) -> int:
        """Cache rows at the end of its longest life; the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.max_new_tokens - 1

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output (known ones: end <= num_known_tokens)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]
