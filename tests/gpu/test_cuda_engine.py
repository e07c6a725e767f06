"""The GPT-2 engine on CUDA. Skipped, with the reason, where no GPU is present (CI has none).

The CPU suite covers the same logic (graph buckets and padding through an eager capture, the gather
attention, the batched sampler); these check what only a GPU can: the captured graphs, the pinned
staging copy, float32 exactness against transformers on the same device, overlapped steps against
synchronous ones, and host syncs per step.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_run import PROMPTS, request, run_with_late_arrivals
from worker.engine import FinishEvent, LLMEngine
from worker.loading import LoadedModel, load, load_hf_model
from worker.scheduler import SchedulerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")

CUDA = torch.device("cuda")
CONFIG = SchedulerConfig(max_batch_size=8, max_prefill_tokens=64, kv_cache_tokens=4096)


def hf_greedy_on_cuda(model_dir: Path) -> dict[str, list[int]]:
    model, tokenizer = load_hf_model(str(model_dir))
    model.to(CUDA)
    out = {}
    for rid, prompt, n in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)], device=CUDA)
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        tokens = ref[0, ids.shape[1] :].tolist()
        eos = tokenizer.eos_token_id
        out[rid] = tokens[: tokens.index(eos)] if eos in tokens else tokens
    return out


@pytest.fixture(scope="module")
def loaded_fp32(tiny_gpt2_dir: Path) -> LoadedModel:
    return load(str(tiny_gpt2_dir), CUDA, torch.float32)


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_float32_greedy_on_cuda_equals_hf_generate_on_cuda(
    tiny_gpt2_dir: Path, loaded_fp32: LoadedModel, cuda_graphs: bool
) -> None:
    engine = LLMEngine.for_model(loaded_fp32, CONFIG, cuda_graphs=cuda_graphs)
    assert (engine.runner.graphs is not None) == cuda_graphs
    finished = run_with_late_arrivals(engine)
    expected = hf_greedy_on_cuda(tiny_gpt2_dir)
    for rid, _, _ in PROMPTS:
        assert finished[rid].seq.output_ids == expected[rid], rid


def test_bfloat16_runs_every_request_and_starts_as_float32_does(tiny_gpt2_dir: Path, loaded_fp32: LoadedModel) -> None:
    reference = run_with_late_arrivals(LLMEngine.for_model(loaded_fp32, CONFIG))
    engine = LLMEngine.for_model(load(str(tiny_gpt2_dir), CUDA, torch.bfloat16), CONFIG)
    finished = run_with_late_arrivals(engine)
    for rid, _, n in PROMPTS:
        ours = finished[rid].seq.output_ids
        assert ours[0] == reference[rid].seq.output_ids[0], rid
        assert len(ours) == n or finished[rid].completion.finish_reason == "eos"


def test_seeded_sampling_on_cuda_is_reproducible(loaded_fp32: LoadedModel) -> None:
    def run() -> list[int]:
        engine = LLMEngine.for_model(loaded_fp32, CONFIG)
        seq = engine.add(request("s", "The quick brown fox", 20, temperature=0.9, top_p=0.9, seed=5, stop_on_eos=False))
        while engine.has_work:
            engine.step()
        return seq.output_ids

    assert run() == run()


def test_overlapped_steps_on_cuda_give_the_synchronous_tokens(loaded_fp32: LoadedModel) -> None:
    overlapped = LLMEngine.for_model(loaded_fp32, CONFIG)
    assert overlapped.overlap  # the default on CUDA
    synchronous = LLMEngine.for_model(loaded_fp32, CONFIG, overlap=False)
    ours, theirs = run_with_late_arrivals(overlapped), run_with_late_arrivals(synchronous)
    for rid, _, _ in PROMPTS:
        assert ours[rid].seq.output_ids == theirs[rid].seq.output_ids, rid
    assert overlapped.scheduler.blocks.num_used == 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_a_graphed_decode_step_makes_no_synchronising_call(
    loaded_fp32: LoadedModel, overlap: bool, sampled: bool
) -> None:
    """A step's tokens come back through a non-blocking copy into pinned memory and an event: the
    host waits on the event, never on a synchronising operation (which would also wait for the
    step launched after it), whether its rows are greedy or drawn (sampling.py's sync-free path)."""
    engine = LLMEngine.for_model(loaded_fp32, CONFIG, overlap=overlap)
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 80, "seed": 3} if sampled else {}
    for i in range(4):
        engine.add(request(str(i), "The quick brown fox", 10, stop_on_eos=False, **params))
    engine.step()  # prefill
    engine.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            events: Any = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not any(isinstance(e, FinishEvent) for e in events)
    # torch also warns, once, that the debug mode is a prototype: count only the operations it caught.
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert not syncs, [str(w.message) for w in syncs]
