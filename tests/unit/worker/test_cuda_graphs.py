"""The decode-graph path, run on the CPU: the capture hands back the forward itself, so the static
buffers, the padding and the bucket choice run exactly as replays would on CUDA."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks.harness.fixtures.tiny_gpt2 import hf_greedy
from tests.engine_run import PROMPTS, request, run_with_late_arrivals
from worker.cuda_graphs import batch_buckets, context_buckets
from worker.engine import LLMEngine
from worker.loading import LoadedModel
from worker.runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig


class EagerCapture:
    """Stands in for CudaGraphCapture: 'replaying' runs the forward again; counts replays per bucket."""

    def __init__(self) -> None:
        self.replays: Counter[tuple[int, int]] = Counter()

    def __call__(self, forward: Callable[[], None]) -> Callable[[], None]:
        assert isinstance(forward, partial)
        bucket = forward.args

        def replay() -> None:
            self.replays[bucket] += 1
            forward()

        return replay


def graph_engine(loaded: LoadedModel, capture: EagerCapture, max_batch_size: int = 8) -> LLMEngine:
    config = SchedulerConfig(max_batch_size=max_batch_size, max_running=8, max_prefill_tokens=64, kv_cache_tokens=4096)
    runner = ModelRunner(loaded.model, config, capture)
    return LLMEngine(runner, loaded.tokenizer, Scheduler(config), max_context=loaded.shape.n_positions)


def test_buckets_cover_every_batch_and_context_up_to_the_largest() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]
    assert context_buckets(128) == [64, 128]
    assert context_buckets(1024) == [64, 128, 256, 512, 1024]
    assert context_buckets(100) == [64, 100]


# One more request decodes past 64 tokens, into the second context bucket.
GRAPH_PROMPTS = [*PROMPTS, ("long", "Continuous batching lets requests join and leave. " * 2, 70)]


def test_greedy_decode_through_graph_replays_equals_hf_generate(loaded: LoadedModel, hf: tuple[Any, Any]) -> None:
    capture = EagerCapture()
    engine = graph_engine(loaded, capture)
    assert engine.runner.graphs is not None
    assert set(engine.runner.graphs.graphs) == {(b, w) for b in (1, 2, 4, 8) for w in (64, 128)}
    capture.replays.clear()  # capturing ran each graph once
    finished = run_with_late_arrivals(engine, GRAPH_PROMPTS)
    for rid, prompt, n in GRAPH_PROMPTS:
        assert finished[rid].seq.output_ids == hf_greedy(hf, prompt, n), rid
    # Decode steps of 6 down to 1 running sequences replayed padded graphs (8, 4, 2, 1) at both
    # context widths.
    assert {batch for batch, _ in capture.replays} == {1, 2, 4, 8}
    assert {width for _, width in capture.replays} == {64, 128}


def test_steps_with_prompt_chunks_or_more_rows_than_the_largest_bucket_run_eagerly(loaded: LoadedModel) -> None:
    capture = EagerCapture()
    engine = graph_engine(loaded, capture, max_batch_size=2)
    capture.replays.clear()
    engine.add(request("a", "The quick brown fox", 5))
    engine.step()  # a prompt chunk: eager
    assert not capture.replays
    engine.step()  # one decode row: the batch-1 graph
    assert capture.replays == Counter({(1, 64): 1})
    # Three one-token prompts beside it: four single-token rows, more than the largest bucket (2).
    for rid in "xyz":
        engine.add(request(rid, "x", 3))
    engine.step()
    assert capture.replays == Counter({(1, 64): 1})


def test_a_narrower_step_leaves_no_stale_block_in_the_static_table(loaded: LoadedModel) -> None:
    """Columns past a step's width and rows past its batch hold the scratch block (columns past a
    row's own length, within the width, are masked by the attention)."""
    engine = graph_engine(loaded, EagerCapture())
    graphs = engine.runner.graphs
    assert graphs is not None
    scratch = engine.runner.cache.scratch_block
    engine.add(request("wide", "Continuous batching lets requests join and leave. " * 2, 30))
    engine.add(request("narrow", "x", 40))
    while engine.scheduler.running and max(len(s.block_table) for s in engine.scheduler.running) < 2:
        engine.step()
    engine.step()
    assert graphs.width >= 2
    wide = next(s for s in engine.scheduler.running if s.request_id == "wide")
    engine.cancel(wide)
    engine.step()  # "narrow" alone, in its one block
    (narrow,) = engine.scheduler.running
    assert len(narrow.block_table) == 1 and graphs.width == 1
    assert graphs.tables[0, 0].item() == narrow.block_table[0]
    others = graphs.tables.clone()
    others[0, 0] = scratch
    assert bool((others == scratch).all())
