"""Overlapped steps (the next launched before the last one's tokens are read) give exactly the
tokens of synchronous steps.

Without a GPU, a stand-in device makes the overlap real: launching a step only queues it, and
waiting for a step's tokens runs the queued steps in order. So when step t+1 is launched, step t
has not run and its tokens exist nowhere: step t+1's decode rows can only get their input from
the device's token buffer, and frees deferred until a step is done are checked against a device
that really has not yet written.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
from torch import Tensor

from tests.engine_run import PROMPTS, drain, request
from tests.unit.worker.test_cuda_graphs import EagerCapture
from tests.unit.worker.test_engine_paging import run_in_two_waves, shared_prefix_requests
from worker.engine import FinishEvent, LLMEngine, TokenEvent
from worker.loading import LoadedModel
from worker.prefill_budget import FLOOR
from worker.runner import ModelRunner, StepHandle
from worker.scheduler import Scheduler, SchedulerConfig
from worker.tokenizer import Tokenizer

Work = Callable[[], Tensor]


class LazyDevice:
    """Stands in for a CUDA stream: `launch` queues a step, `wait` runs every step queued up to it."""

    def __init__(self) -> None:
        self.queue: deque[_Queued] = deque()
        self.ran = 0

    def __call__(self, work: Work) -> StepHandle:
        queued = _Queued(self, work)
        self.queue.append(queued)
        return queued

    def catch_up(self) -> None:
        """Run every queued step, as a device does while the host is busy elsewhere."""
        if self.queue:
            self.queue[-1].wait()


class _Queued:
    def __init__(self, device: LazyDevice, work: Work) -> None:
        self.device, self.work = device, work
        self.tokens: list[int] | None = None

    def wait(self) -> list[int]:
        while self.tokens is None:
            head = self.device.queue.popleft()
            head.tokens = head.work().tolist()
            self.device.ran += 1
        return self.tokens

    def done(self) -> bool:
        return self.tokens is not None


BASE = {"max_batch_size": 8, "max_prefill_tokens": 64, "kv_cache_tokens": 4096}


class EndsAt:
    """The model's tokenizer, with another token as end-of-sequence: one the tiny random model
    samples mid-stream, which its own end-of-text token it does not."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def make_engine(
    loaded: LoadedModel, overlap: bool, graphs: bool = False, eos: int | None = None, **overrides: Any
) -> LLMEngine:
    config = SchedulerConfig(**{**BASE, "max_model_len": loaded.shape.n_positions, **overrides})
    launcher = LazyDevice() if overlap else None
    runner = ModelRunner(loaded.model, config, EagerCapture() if graphs else None, launcher)
    tokenizer: Any = loaded.tokenizer if eos is None else EndsAt(loaded.tokenizer, eos)
    return LLMEngine(runner, tokenizer, Scheduler(config), loaded.shape.n_positions, overlap=overlap)


Streams = dict[str, list[TokenEvent | FinishEvent]]


def run_late_arrivals(engine: LLMEngine, prompts: list[tuple[str, str, int, dict[str, Any]]]) -> Streams:
    """The first half at once, the rest after four steps; every event, by request."""
    events: Streams = {}
    half = len(prompts) // 2
    for rid, prompt, n, kw in prompts[:half]:
        engine.add(request(rid, prompt, n, **kw))
    for _ in range(4):
        for event in engine.step():
            events.setdefault(event.seq.request_id, []).append(event)
    for rid, prompt, n, kw in prompts[half:]:
        engine.add(request(rid, prompt, n, **kw))
    drain(engine, events)
    return events


def outcome(events: Streams) -> dict[str, tuple[list[int], str, str, str]]:
    """Per request: streamed ids, streamed text, final text, finish reason; checked gapless."""
    result = {}
    for rid, stream in events.items():
        tokens = [e for e in stream if isinstance(e, TokenEvent)]
        (final,) = [e for e in stream if isinstance(e, FinishEvent)]
        assert [t.index for t in tokens] == list(range(len(tokens))), rid
        assert [t.token_id for t in tokens] == final.seq.output_ids, rid
        text = "".join(t.text for t in tokens)
        result[rid] = ([t.token_id for t in tokens], text, final.completion.text, final.completion.finish_reason)
    return result


def assert_idle(engine: LLMEngine) -> None:
    blocks = engine.scheduler.blocks
    assert not engine.has_work and blocks.num_used == 0
    assert blocks.num_used + blocks.num_cached + blocks.num_free == blocks.num_blocks


GREEDY = [(rid, prompt, n, {}) for rid, prompt, n in PROMPTS]
SAMPLED = [
    ("s1", "The quick brown fox", 30, {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7}),
    ("s2", "Governors keep", 25, {"temperature": 1.0, "seed": 8}),
    ("g1", "naïve café", 20, {}),
    ("s3", "x" * 20, 18, {"temperature": 1.3, "top_p": 0.8, "seed": 9, "stop_on_eos": False}),
]

CASES = {
    "eos mid-batch, late arrivals": ({"eos": "mid-stream"}, GREEDY),
    "seeded sampling": ({}, SAMPLED),
    "chunked prefill": ({"max_prefill_tokens": 8}, GREEDY),
    "more running than the decode batch": ({"max_batch_size": 2, "max_running": 5}, GREEDY),
    "preemption in a tiny pool": ({"kv_cache_tokens": 96, "kv_block_size": 8}, GREEDY),
    "worst-case reservation": ({"kv_cache_tokens": 256, "kv_reservation": "worst-case"}, GREEDY),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("graphs", [False, True])
def test_overlapped_steps_give_the_tokens_of_synchronous_ones(loaded: LoadedModel, case: str, graphs: bool) -> None:
    overrides, prompts = CASES[case]
    if overrides.get("eos") == "mid-stream":  # the 6th token of the first stream ends it and others
        first = outcome(run_late_arrivals(make_engine(loaded, overlap=False), prompts))
        overrides = {"eos": first[prompts[0][0]][0][5]}
    sync = make_engine(loaded, overlap=False, graphs=graphs, **overrides)
    expected = outcome(run_late_arrivals(sync, prompts))
    overlapped = make_engine(loaded, overlap=True, graphs=graphs, **overrides)
    assert outcome(run_late_arrivals(overlapped, prompts)) == expected
    assert_idle(sync)
    assert_idle(overlapped)
    reasons = {reason for _, _, _, reason in expected.values()}
    if case.startswith("eos"):
        assert reasons == {"eos", "length"}  # some stop early, others run to their length
    if case.startswith("preemption"):
        assert overlapped.scheduler.num_preemptions > 0 and sync.scheduler.num_preemptions > 0


def test_overlapped_steps_read_tokens_the_host_does_not_have_yet(loaded: LoadedModel) -> None:
    engine = make_engine(loaded, overlap=True)
    device = engine.runner.launcher
    assert isinstance(device, LazyDevice)
    engine.add(request("a", "The quick brown fox", 10, stop_on_eos=False))
    assert engine.step() == []  # the prefill is launched; nothing has run
    assert device.ran == 0 and len(device.queue) == 1
    first = engine.step()  # the first decode is launched, then the prefill's token is read
    assert [type(e) for e in first] == [TokenEvent] and device.ran == 1 and len(device.queue) == 1
    (seq,) = engine.scheduler.running
    assert seq.num_pending == 1 and len(seq.output_ids) == 1  # the decode's token is on its way


def test_prefix_hits_with_overlap_give_the_synchronous_tokens(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode("Governors keep inference workers healthy under bursts of traffic. " * 4)
    prompts = shared_prefix_requests(ids)
    results = []
    for overlap in (False, True):
        engine = make_engine(loaded, overlap, kv_block_size=8)
        finished = run_in_two_waves(engine, prompts)
        results.append({rid: (e.seq.output_ids, e.completion.cached_prompt_tokens) for rid, e in finished.items()})
        assert engine.scheduler.blocks.counters.hits > 0
        assert_idle(engine)
    sync, overlapped = results
    assert {rid: ids for rid, (ids, _) in overlapped.items()} == {rid: ids for rid, (ids, _) in sync.items()}


def test_a_cancel_while_a_step_is_in_flight_frees_its_blocks_once_that_step_is_done(loaded: LoadedModel) -> None:
    sync = make_engine(loaded, overlap=False)
    sync.add(request("long", "The quick brown fox", 40, stop_on_eos=False))
    sync.add(request("other", "Governors keep", 20, stop_on_eos=False))
    expected = {rid: e.seq.output_ids for rid, e in drain(sync).items()}

    engine = make_engine(loaded, overlap=True)
    long = engine.add(request("long", "The quick brown fox", 40, stop_on_eos=False))
    engine.add(request("other", "Governors keep", 20, stop_on_eos=False))
    for _ in range(5):
        engine.step()
    assert long.num_pending > 0  # its next token is being computed
    held = len(long.block_table)
    used = engine.scheduler.blocks.num_used
    event = engine.cancel(long)
    assert event is not None and event.completion.finish_reason == "cancelled"
    assert long.block_table and engine.scheduler.blocks.num_used == used  # the step in flight may write them
    events: Streams = {}
    drain(engine, events)
    assert "long" not in events  # the row computed for it was thrown away
    assert long.output_ids == expected["long"][: len(long.output_ids)]
    finals = [e for e in events["other"] if isinstance(e, FinishEvent)]
    assert finals[0].seq.output_ids == expected["other"]
    assert held > 0 and not long.block_table
    assert_idle(engine)


def test_a_failed_step_in_flight_leaves_nothing_held(loaded: LoadedModel) -> None:
    engine = make_engine(loaded, overlap=True)
    engine.add(request("a", "The quick brown fox", 20, stop_on_eos=False))
    for _ in range(3):
        engine.step()
    assert engine.has_work and engine.scheduler.running
    (seq,) = engine.scheduler.running
    assert seq.num_pending == 1  # a step is in flight
    engine.fail_all()
    assert_idle(engine)
    assert engine.step() == [] and not engine.scheduler.running


@pytest.mark.parametrize("overlap", [False, True])
def test_the_block_an_end_of_sequence_row_fills_is_offered_to_the_prefix_cache(
    loaded: LoadedModel, overlap: bool
) -> None:
    """A 6-token prompt in blocks of 4 whose third sampled token ends it: the row that sampled it
    filled the second block (prompt + two tokens), so a follow-up turn finds 8 tokens cached."""
    plain = make_engine(loaded, overlap=False, kv_block_size=4)
    for text in ("The quick brown fox", "Governors keep", "naïve café", "x y z", "Continuous batching"):
        prompt = loaded.tokenizer.encode(text)[:6]
        if len(prompt) < 6:
            continue
        plain.add_tokenized(request("probe", "", 3, stop_on_eos=False), prompt)
        greedy = drain(plain)["probe"].seq.output_ids
        if greedy[2] not in greedy[:2]:
            break
    else:
        pytest.fail("no prompt whose third greedy token differs from the first two")
    engine = make_engine(loaded, overlap, eos=greedy[2], kv_block_size=4)
    engine.add_tokenized(request("turn-1", "", 10), prompt)
    first = drain(engine)["turn-1"]
    assert first.completion.finish_reason == "eos" and first.seq.output_ids == greedy[:2]
    engine.add_tokenized(request("turn-2", "", 2, stop_on_eos=False), prompt + greedy[:2] + prompt[:3])
    assert drain(engine)["turn-2"].completion.cached_prompt_tokens == 8


def test_blocks_come_back_before_the_next_step_once_the_device_is_through_the_one_in_flight(
    loaded: LoadedModel,
) -> None:
    engine = make_engine(loaded, overlap=True)
    device = engine.runner.launcher
    assert isinstance(device, LazyDevice)
    long = engine.add(request("long", "The quick brown fox", 40, stop_on_eos=False))
    engine.add(request("other", "Governors keep", 20, stop_on_eos=False))
    for _ in range(4):
        engine.step()
    used = engine.scheduler.blocks.num_used
    engine.cancel(long)
    assert long.block_table and engine.scheduler.blocks.num_used == used  # the step in flight may write them
    device.catch_up()  # the device finishes that step while the host is elsewhere
    held_when_scheduling = []
    schedule = engine.scheduler.schedule

    def watched(*args: Any, **kwargs: Any) -> Any:
        held_when_scheduling.append(len(long.block_table))
        return schedule(*args, **kwargs)

    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    engine.step()
    assert held_when_scheduling == [0]  # free for the very next step, not the one after
    assert engine.scheduler.blocks.num_used < used
    drain(engine)
    assert_idle(engine)


def test_overlapped_steps_on_the_cpu_take_the_budgets_floor_beside_streams(loaded: LoadedModel) -> None:
    """Overlapped steps give no step timing to learn a prompt budget from: beside decoding
    streams a step takes the floor, never a whole 2,048-token prompt."""
    config = SchedulerConfig(max_batch_size=8, max_prefill_tokens=2048, kv_cache_tokens=4096)
    engine = LLMEngine.for_model(loaded, config, overlap=True, learned_prefill=True)
    assert engine.prefill_budget is None and engine.scheduler.prefill_while_decoding == FLOOR
    learning = LLMEngine.for_model(loaded, config, overlap=False, learned_prefill=True)
    assert learning.prefill_budget is not None
