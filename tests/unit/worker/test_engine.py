"""The GPT-2 engine core on a real (tiny) model, judged against transformers' own `generate`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.harness.fixtures.tiny_gpt2 import N_POSITIONS, hf_greedy
from govwire.errors import BadFrame
from tests.engine_run import PROMPTS, drain, request, run_with_late_arrivals
from worker import runner as runner_module
from worker.engine import FinishEvent, LLMEngine, TokenEvent
from worker.errors import ModelLoadError
from worker.kernels.decode_attention import cpu_decode_attention
from worker.loading import DTYPES, LoadedModel, load
from worker.scheduler import SchedulerConfig
from worker.sequence import Sequence

CPU = torch.device("cpu")


def make_engine(loaded: LoadedModel, **overrides: Any) -> LLMEngine:
    config = SchedulerConfig(**{"max_batch_size": 8, "max_prefill_tokens": 64, "kv_cache_tokens": 4096, **overrides})
    return LLMEngine.for_model(loaded, config)


def test_loads_a_local_directory_through_from_pretrained(loaded: LoadedModel, hf: tuple[Any, Any]) -> None:
    model, tokenizer = hf
    assert loaded.shape.n_positions == N_POSITIONS
    assert loaded.tokenizer.encode("Hello") == tokenizer.encode("Hello")
    assert torch.equal(loaded.model.transformer.wte.weight, model.transformer.wte.weight)


def test_refuses_a_missing_or_non_gpt2_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        load(str(tmp_path / "absent"), CPU, torch.float32)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelLoadError, match="this engine runs gpt2"):
        load(str(tmp_path), CPU, torch.float32)


@pytest.mark.parametrize("decode", ["kernel", "gather"])
@pytest.mark.parametrize("batching", [{}, {"max_batch_size": 2, "max_running": 5}], ids=["all-decode", "taking-turns"])
def test_greedy_tokens_equal_hf_generate_for_a_mixed_batch_with_late_arrivals(
    loaded: LoadedModel, hf: tuple[Any, Any], batching: dict[str, int], decode: str
) -> None:
    # A 64-token prefill budget splits the long prompts into chunks, and the last two requests
    # arrive while the first three are mid-decode; with a decode batch of 2 under 5 running
    # requests, they also take turns at decoding. Decode attention by the C kernel, and by the
    # gather path that CUDA runs and a CPU without a C compiler falls back to.
    engine = make_engine(loaded, **batching)
    assert engine.runner.kernel is not None, "the test machine has a C compiler"
    if decode == "gather":
        engine.runner.kernel = None
    finished = run_with_late_arrivals(engine)
    assert len(finished) == len(PROMPTS)
    for rid, prompt, n in PROMPTS:
        expected = hf_greedy(hf, prompt, n)
        assert finished[rid].seq.output_ids == expected, rid
        completion = finished[rid].completion
        assert completion.finish_reason == ("length" if len(expected) == n else "eos")
        assert completion.text == loaded.tokenizer.decode(expected)


def test_streamed_pieces_add_up_to_the_final_text(loaded: LoadedModel) -> None:
    # (A random model emits invalid byte sequences too; pieces of valid text are never split:
    # see test_tokenizer.py.)
    engine = make_engine(loaded)
    for rid, prompt, n in PROMPTS:
        engine.add(request(rid, prompt, n, temperature=1.0, seed=7, stop_on_eos=False))
    events: dict[str, list[TokenEvent | FinishEvent]] = {}
    finished = drain(engine, events)
    for rid, _, n in PROMPTS:
        tokens = [e for e in events[rid] if isinstance(e, TokenEvent)]
        assert [t.index for t in tokens] == list(range(n))
        assert "".join(t.text for t in tokens) == finished[rid].completion.text


def test_streamed_pieces_add_up_to_the_text_however_a_request_ends() -> None:
    # The byte-level random model samples invalid and unfinished UTF-8 and, at temperature 2, its
    # end-of-sequence often enough: a request ending (EOS, cancelled) while its detokenizer held
    # the start of a character streams that too, so no ending loses text from the stream.
    engine = make_engine(load("random-tiny", CPU, torch.float32), max_batch_size=64)
    for i in range(96):
        engine.add(request(f"r{i}", "x", 48, temperature=2.0, seed=i))
    events: dict[str, list[TokenEvent | FinishEvent]] = {}
    finished: dict[str, FinishEvent] = {}
    for step in range(1000):
        if not engine.has_work:
            break
        if step == 20:  # cancel a third of them midway, at a step boundary as the backend does
            for event in [engine.cancel(seq) for seq in list(engine.scheduler.running)[::3]]:
                if event is not None:
                    events.setdefault(event.seq.request_id, []).append(event)
                    finished[event.seq.request_id] = event
        for event in engine.step():
            events.setdefault(event.seq.request_id, []).append(event)
            if isinstance(event, FinishEvent):
                finished[event.seq.request_id] = event
    reasons = {e.completion.finish_reason for e in finished.values()}
    assert {"eos", "length", "cancelled"} <= reasons and len(finished) == 96
    tails = 0
    for rid, end in finished.items():
        streamed = "".join(e.text for e in events[rid] if isinstance(e, TokenEvent)) + end.tail
        assert streamed == end.completion.text, rid
        tails += end.tail != ""
    assert tails > 0  # the case this is about happened


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(loaded: LoadedModel) -> None:
    sampling = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 42, "stop_on_eos": False}
    alone = make_engine(loaded)
    alone.add(request("s", "The quick brown fox", 30, **sampling))
    solo = drain(alone)["s"].seq.output_ids

    crowded = make_engine(loaded)
    crowded.add(request("other1", "Governors keep", 20, temperature=1.0, seed=1, stop_on_eos=False))
    crowded.step()
    crowded.add(request("s", "The quick brown fox", 30, **sampling))
    crowded.add(request("other2", "x" * 50, 10, temperature=1.0, stop_on_eos=False))
    assert drain(crowded)["s"].seq.output_ids == solo

    other_seed = make_engine(loaded)
    other_seed.add(request("s", "The quick brown fox", 30, **{**sampling, "seed": 43}))
    assert drain(other_seed)["s"].seq.output_ids != solo


def test_cancel_mid_decode_leaves_the_batch_and_frees_its_kv_blocks(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    long = engine.add(request("long", "The quick brown fox", 100, stop_on_eos=False))
    other = engine.add(request("other", "Governors keep", 5, stop_on_eos=False))
    for _ in range(3):
        engine.step()
    event = engine.cancel(long)
    assert event is not None
    assert event.completion.finish_reason == "cancelled"
    assert event.completion.completion_tokens == len(long.output_ids) > 0
    assert list(engine.scheduler.running) == [other]
    assert engine.scheduler.blocks.num_used == len(other.block_table) > 0
    drain(engine)
    assert engine.scheduler.blocks.num_used == 0
    assert engine.cancel(long) is None  # already gone: a late cancel is a no-op


def test_a_request_beyond_the_model_context_is_bad_frame_naming_the_limit(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    prompt_tokens = len(loaded.tokenizer.encode("x" * 100))
    with pytest.raises(BadFrame, match=f"context of {N_POSITIONS} tokens") as info:
        engine.add(request("r", "x" * 100, N_POSITIONS - prompt_tokens + 1))
    assert info.value.request_id == "r"
    engine.add(request("ok", "x" * 100, N_POSITIONS - prompt_tokens))  # exactly at the limit is fine
    with pytest.raises(BadFrame, match="prompt is empty"):
        engine.add(request("e", "", 4))


def test_a_request_larger_than_the_whole_kv_cache_is_bad_frame(loaded: LoadedModel) -> None:
    engine = make_engine(loaded, kv_cache_tokens=32)
    with pytest.raises(BadFrame, match="cache holds 32 .--kv-cache-tokens 32 in blocks of 16"):
        engine.add(request("r", "The quick brown fox", 40))


@pytest.mark.parametrize("reservation", ["paged", "worst-case"])
def test_requests_wait_for_kv_room_and_the_budget_is_never_exceeded(loaded: LoadedModel, reservation: str) -> None:
    engine = make_engine(loaded, kv_cache_tokens=64, kv_block_size=8, kv_reservation=reservation)
    seqs: list[Sequence] = [
        engine.add(request(str(i), prompt, 20, stop_on_eos=False)) for i, (_, prompt, _) in enumerate(PROMPTS[:2] * 3)
    ]
    peak = 0
    while engine.has_work:
        engine.step()
        held = {b for s in engine.scheduler.running for b in s.block_table}
        assert len(held) == engine.scheduler.blocks.num_used <= 8
        peak = max(peak, len(held))
    assert all(len(s.output_ids) == 20 for s in seqs)
    assert peak > 4
    assert max(s.t_admitted - s.t_arrival for s in seqs if s.t_admitted is not None) > 0


def test_the_embedded_random_tiny_model_needs_no_files() -> None:
    tiny = load("random-tiny", CPU, torch.float32)
    again = load("random-tiny", CPU, torch.float32)
    assert tiny.shape.n_layer == 2 and tiny.tokenizer.vocab_size == tiny.shape.vocab_size == 257
    assert torch.equal(tiny.model.transformer.wte.weight, again.model.transformer.wte.weight)  # seeded
    engine = LLMEngine.for_model(tiny, SchedulerConfig(kv_cache_tokens=256))
    engine.add(request("t", "héllo", 5, stop_on_eos=False))
    assert len(drain(engine)["t"].seq.output_ids) == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_on_the_cpu_runs_every_request_and_starts_as_float32_does(
    tiny_gpt2_dir: Path, loaded: LoadedModel, dtype: torch.dtype
) -> None:
    # Free-running greedy streams part at the first near-tie (bfloat16 keeps 8 bits of mantissa),
    # so only the first tokens are compared here; benchmarks/engine/dtypes.py measures the agreement.
    reference = run_with_late_arrivals(make_engine(loaded))
    low = load(str(tiny_gpt2_dir), CPU, dtype)
    engine = make_engine(low)
    assert engine.runner.kernel is not None and engine.runner.cache.keys.dtype == dtype
    assert_starts_alike(run_with_late_arrivals(engine), reference)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_float32_model_over_a_16_bit_kv_cache_runs_every_request_and_starts_as_float32_does(
    tiny_gpt2_dir: Path, loaded: LoadedModel, kv_dtype: str
) -> None:
    """--kv-cache-dtype: float32 layers, attention (prefill and the decode kernel) in the cache's dtype."""
    reference = run_with_late_arrivals(make_engine(loaded))
    mixed = load(str(tiny_gpt2_dir), CPU, torch.float32, kv_cache_dtype=kv_dtype)
    engine = make_engine(mixed)
    assert engine.runner.kernel is not None and engine.runner.dtype == torch.float32
    assert engine.runner.cache.keys.dtype == DTYPES[kv_dtype]
    assert_starts_alike(run_with_late_arrivals(engine), reference)


def test_a_kv_cache_dtype_the_kernel_was_not_built_for_decodes_through_torch(
    tiny_gpt2_dir: Path, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler without _Float16 builds the kernel with no float16 function: a float16 cache then
    decodes through torch's GatherDecode, as attention runs in the cache's dtype, whatever the model's."""
    kernel = cpu_decode_attention()
    assert kernel is not None
    without_float16 = copy.copy(kernel)
    without_float16.dtypes = {dtype: f for dtype, f in kernel.dtypes.items() if dtype != torch.float16}
    monkeypatch.setattr(runner_module, "cpu_decode_attention", lambda: without_float16)
    reference = run_with_late_arrivals(make_engine(loaded))
    engine = make_engine(load(str(tiny_gpt2_dir), CPU, torch.float32, kv_cache_dtype="float16"))
    assert engine.runner.kernel is None and engine.runner.cache.keys.dtype == torch.float16
    assert_starts_alike(run_with_late_arrivals(engine), reference)


def assert_starts_alike(finished: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every request ran to its length (or end of sequence) and began with the reference's token."""
    for rid, _, n in PROMPTS:
        ours, theirs = finished[rid].seq.output_ids, reference[rid].seq.output_ids
        assert ours[0] == theirs[0], rid
        assert len(ours) == n or finished[rid].completion.finish_reason == "eos"


def test_refuses_a_checkpoint_whose_forward_the_engine_does_not_implement(tmp_path: Path, tiny_gpt2_dir: Path) -> None:
    import shutil

    for option, value in [("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True)]:
        copy = tmp_path / option
        shutil.copytree(tiny_gpt2_dir, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, option: value}))
        with pytest.raises(ModelLoadError, match=f"does not implement {option}="):
            load(str(copy), CPU, torch.float32)
