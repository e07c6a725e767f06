"""Paged KV on a real (tiny) model: prefix-cache hits and preemptions never change a greedy output.

Every output is judged against transformers' own greedy `generate` of the prompt alone, so a hit
on a prefix that ends mid-block or exactly on a block boundary, a sequence preempted mid-decode and
recomputed, and both at once, must reproduce it token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine_run import drain, request
from worker.engine import FinishEvent, LLMEngine, TokenEvent
from worker.loading import LoadedModel
from worker.scheduler import SchedulerConfig

BLOCK = 8


def make_engine(loaded: LoadedModel, **overrides: Any) -> LLMEngine:
    config = {"max_batch_size": 8, "max_prefill_tokens": 64, "kv_cache_tokens": 1024, "kv_block_size": BLOCK}
    return LLMEngine.for_model(loaded, SchedulerConfig(**{**config, **overrides}))


def hf_greedy_ids(hf: tuple[Any, Any], ids: list[int], max_new_tokens: int) -> list[int]:
    model, tokenizer = hf
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    tokens: list[int] = out[0, len(ids) :].tolist()
    eos = tokenizer.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.fixture(scope="module")
def text_ids(loaded: LoadedModel) -> list[int]:
    text = "Governors keep inference workers healthy under bursts of traffic. The quick brown fox jumps. " * 3
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= 60
    return ids


def shared_prefix_requests(ids: list[int]) -> list[tuple[str, list[int], int]]:
    """Pairs that share a prefix of 13 (mid-block), 16 (exactly two blocks) and 27 tokens, a prompt
    that is exactly three full blocks asked twice, and one that shares nothing."""
    other = list(reversed(ids))
    return [
        ("mid-a", ids[:13] + other[:5], 20),
        ("mid-b", ids[:13] + other[7:10], 20),
        ("two-a", ids[:16] + other[:9], 20),
        ("two-b", ids[:16] + other[20:22], 20),
        ("long-a", ids[:27] + other[:2], 20),
        ("long-b", ids[:27] + other[30:41], 20),
        ("exact-a", [ids[5]] * 24, 20),
        ("exact-b", [ids[5]] * 24, 20),
        ("alone", other[40:50], 20),
    ]


def run_in_two_waves(engine: LLMEngine, prompts: list[tuple[str, list[int], int]]) -> dict[str, Any]:
    """The `-a` requests (and `alone`) first; the others once those have started decoding, so their
    prefixes are in the cache. Returns finish events, and checks every stream is gapless."""
    events: dict[str, list[TokenEvent | FinishEvent]] = {}
    first = [p for p in prompts if not p[0].endswith("-b")]
    for rid, ids, n in first:
        engine.add_tokenized(request(rid, "", n), ids)
    for _ in range(3):
        for event in engine.step():
            events.setdefault(event.seq.request_id, []).append(event)
    for rid, ids, n in prompts:
        if rid.endswith("-b"):
            engine.add_tokenized(request(rid, "", n), ids)
    finished = drain(engine, events)
    for rid, stream in events.items():
        tokens = [e for e in stream if isinstance(e, TokenEvent)]
        assert [t.index for t in tokens] == list(range(len(finished[rid].seq.output_ids))), rid
        assert [t.token_id for t in tokens] == finished[rid].seq.output_ids, rid
    return finished


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefixes_of_every_shape_give_hf_greedy_outputs(
    loaded: LoadedModel, hf: tuple[Any, Any], text_ids: list[int], prefix_caching: bool
) -> None:
    engine = make_engine(loaded, prefix_caching=prefix_caching)
    prompts = shared_prefix_requests(text_ids)
    finished = run_in_two_waves(engine, prompts)
    for rid, ids, n in prompts:
        assert finished[rid].seq.output_ids == hf_greedy_ids(hf, ids, n), rid
    cached = {rid: finished[rid].completion.cached_prompt_tokens for rid, _, _ in prompts}
    if prefix_caching:
        # Whole blocks only, and never a prompt's last token: 13 -> 8, 16 -> 16, 27 -> 24, 24 of 24 -> 16.
        assert cached == {
            **dict.fromkeys(["mid-a", "two-a", "long-a", "exact-a", "alone"], 0),
            **{"mid-b": 8, "two-b": 16, "long-b": 24, "exact-b": 16},
        }
        assert engine.scheduler.blocks.counters.hits == 64
    else:
        assert set(cached.values()) == {0} and engine.scheduler.blocks.num_cached == 0
    assert engine.scheduler.blocks.num_used == 0


@pytest.mark.parametrize("reservation", ["paged", "worst-case"])
def test_sequences_preempted_mid_decode_resume_with_hf_greedy_outputs(
    loaded: LoadedModel, hf: tuple[Any, Any], text_ids: list[int], reservation: str
) -> None:
    # 12 blocks of 8 tokens for six requests of up to 10 + 40 tokens: they cannot all grow at once.
    engine = make_engine(loaded, kv_cache_tokens=96, prefix_caching=False, kv_reservation=reservation)
    prompts = [(f"r{i}", text_ids[i * 7 : i * 7 + 4 + i], 40) for i in range(6)]
    events: dict[str, list[TokenEvent | FinishEvent]] = {}
    for rid, ids, n in prompts:
        engine.add_tokenized(request(rid, "", n), ids)
    finished = drain(engine, events)
    for rid, ids, n in prompts:
        tokens = [e for e in events[rid] if isinstance(e, TokenEvent)]
        expected = hf_greedy_ids(hf, ids, n)
        assert [t.index for t in tokens] == list(range(len(expected))), rid  # no gap, no repeat
        assert [t.token_id for t in tokens] == expected, rid
        assert finished[rid].completion.text == loaded.tokenizer.decode([t.token_id for t in tokens])
    if reservation == "paged":
        assert engine.scheduler.num_preemptions > 0
        assert max(finished[rid].seq.num_admissions for rid, _, _ in prompts) > 1
    else:
        assert engine.scheduler.num_preemptions == 0
    assert engine.scheduler.blocks.num_used == 0 and engine.scheduler.blocks.num_free == 12


def test_preemption_and_prefix_hits_together_give_hf_greedy_outputs(
    loaded: LoadedModel, hf: tuple[Any, Any], text_ids: list[int]
) -> None:
    engine = make_engine(loaded, kv_cache_tokens=160, max_prefill_tokens=24)
    prompts = shared_prefix_requests(text_ids)
    finished = run_in_two_waves(engine, prompts)
    for rid, ids, n in prompts:
        assert finished[rid].seq.output_ids == hf_greedy_ids(hf, ids, n), rid
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.blocks.counters.hits > 0
    assert engine.scheduler.blocks.num_used == 0
