"""The engine's host work per decode step, per sequence, with the model's own time taken out.

    python -m benchmarks.engine.host_step [--batch 256] [--prompt-tokens 32] [--new-tokens 64] [--steps 32]
        [--model tiny|trained]

The tests' tiny GPT-2 (2 layers, 64 wide, a trained 400-entry byte-level BPE;
benchmarks/harness/fixtures/tiny_gpt2.py; random-tiny's shape), loaded through `from_pretrained` on
the CPU in float32: its forward is small, so a step is mostly the host's work, which is what this
measures. `--model trained`: the 4-layer 256-wide trained model (benchmarks/harness/model_dir.py
--trained; issue 61 holds it at batch 32) instead, on 2 threads as the worker runs it. `--batch`
requests of `--prompt-tokens`-token prompts each generate `--new-tokens` tokens, end-of-sequence
ignored, under `--max-batch-size --batch`. After the prefill, `--steps` decode steps are timed
phase by phase:

- schedule: `Scheduler.schedule` (who runs, block checks, the persistent batch's counters);
- plan + stage: `ModelRunner.launch` less the device's part of the step (`_execute`: the forward,
  sampling, the token buffer's gather and scatter), its staging (the one transfer) counted back in;
- postprocess: the engine's completion of the step (stop checks, prefix keys, detokenizing,
  events);
- emit: what the worker does per event to send it: the backend's delivery list and `_dispatch`,
  which encodes each token's frame (`encode_token`), here on one thread.

Greedy. It prints µs per sequence per step (the median step), the device's time beside them, and
the host's share of the step, and writes benchmarks/results/engine/host_step.json (host_step-trained
for the trained model). Issue 45's targets: host work <= 6 µs per sequence per step at batch 256,
schedule + plan <= 2, postprocess + emit <= 4; issue 61's: the host's share of the step < 20% (at
batch 256 on random-tiny's shape and at batch 32 on the trained model).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.common import machine
from benchmarks.harness.fixtures.tiny_gpt2 import save_tiny_gpt2
from benchmarks.harness.model_dir import ensure_trained
from benchmarks.harness.results import Sitting
from govwire.codec import encode_token
from govwire.request import GenerateRequest
from worker.backends.gpt2 import _dispatch
from worker.engine import LLMEngine, TokenEvent
from worker.loading import load
from worker.scheduler import SchedulerConfig


class _Timed:
    """Adds the wall time of each call of `fn` to `spent`."""

    def __init__(self, fn: Callable[..., Any], spent: list[float]) -> None:
        self._fn, self._spent = fn, spent

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._spent[0] += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


class _FrameSink:
    """A request's sink as the worker's server has it, less the socket: each token's frame encoded."""

    __slots__ = ("frames", "id")

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.frames: list[bytes] = []

    def token(self, index: int, token_id: int, text: str) -> None:
        self.frames.append(encode_token(self.id, index, token_id, text))

    def done(self, completion: object) -> None:
        pass

    def error(self, error: object) -> None:
        pass


def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    loaded = load(str(model_dir), torch.device("cpu"), torch.float32)
    config = SchedulerConfig(
        max_batch_size=args.batch,
        prefill_max_batch_size=args.batch,
        max_prefill_tokens=args.batch * args.prompt_tokens,
        kv_cache_tokens=args.batch * (args.prompt_tokens + args.new_tokens + 16),
    )
    engine = LLMEngine.for_model(loaded, config, overlap=False)
    vocab = loaded.shape.vocab_size
    sinks = {}
    for i in range(args.batch):
        ids = [(i * 7 + j * 13) % (vocab - 1) for j in range(args.prompt_tokens)]
        seq = engine.add_tokenized(
            GenerateRequest(id=str(i), prompt="", max_new_tokens=args.new_tokens, temperature=0.0, stop_on_eos=False),
            ids,
        )
        sinks[seq] = _FrameSink(str(i))
    engine.step()  # the prefill: every prompt at once, each samples its first token
    device, staging = [0.0], [0.0]
    runner = engine.runner
    runner._execute = _Timed(runner._execute, device)  # type: ignore[method-assign]
    runner._stage = _Timed(runner._stage, staging)  # type: ignore[method-assign]
    scheduler = engine.scheduler
    real_schedule, real_launch, real_complete = scheduler.schedule, runner.launch, engine._complete
    spent = {"schedule": [0.0], "launch": [0.0], "complete": [0.0]}
    scheduler.schedule = _Timed(real_schedule, spent["schedule"])  # type: ignore[method-assign]
    runner.launch = _Timed(real_launch, spent["launch"])  # type: ignore[method-assign]
    engine._complete = _Timed(real_complete, spent["complete"])  # type: ignore[method-assign]
    rows: dict[str, list[float]] = {k: [] for k in ("schedule", "plan + stage", "postprocess", "emit", "device")}
    for _ in range(args.steps):
        for cell in (*spent.values(), device, staging):
            cell[0] = 0.0
        events = engine.step()
        started = time.perf_counter()
        out = [(sinks[e.seq], e) for e in events if isinstance(e, TokenEvent)]
        _dispatch(out)  # type: ignore[arg-type]
        emit = time.perf_counter() - started
        assert len(out) == args.batch, "every sequence decodes in every timed step"
        per = 1e6 / args.batch
        # On the CPU the device's part runs inside the launch.
        rows["schedule"].append(spent["schedule"][0] * per)
        rows["plan + stage"].append((spent["launch"][0] - device[0] + staging[0]) * per)
        rows["postprocess"].append(spent["complete"][0] * per)
        rows["emit"].append(emit * per)
        rows["device"].append((device[0] - staging[0]) * per)
    return {name: statistics.median(values) for name, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--model", choices=("tiny", "trained"), default="tiny")
    args = parser.parse_args()
    if args.steps >= args.new_tokens:
        parser.error("--steps must be below --new-tokens: every timed step decodes the whole batch")
    sitting = Sitting(measures=("worker",), part=None if args.model == "tiny" else args.model)
    if args.model == "trained":
        torch.set_num_threads(2)
        medians = measure(args, ensure_trained())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            medians = measure(args, save_tiny_gpt2(Path(tmp)))
    host = medians["schedule"] + medians["plan + stage"] + medians["postprocess"] + medians["emit"]
    share = host / (host + medians["device"])
    print(f"{machine()}; batch {args.batch}, {args.prompt_tokens}-token prompts, median of {args.steps} decode steps")
    print("µs per sequence per step:")
    for name, value in medians.items():
        print(f"  {name:<14}{value:7.2f}")
    print(f"  {'host, total':<14}{host:7.2f}")
    print(f"host share of the step: {share:.1%}")
    shape = f"batch {args.batch}" + (", the trained model" if args.model == "trained" else "")
    sitting.figure(f"host share of the step, {shape}", share * 100, "%", bar="< 20%", met=share < 0.2)
    sitting.figure(f"host work per sequence per step, {shape}", host, "µs", bar="<= 6 µs", met=host <= 6.0)
    planning = medians["schedule"] + medians["plan + stage"]
    sitting.figure(f"schedule + plan + stage per sequence, {shape}", planning, "µs", bar="<= 2 µs", met=planning <= 2.0)
    finishing = medians["postprocess"] + medians["emit"]
    sitting.figure(f"postprocess + emit per sequence, {shape}", finishing, "µs", bar="<= 4 µs", met=finishing <= 4.0)
    for name, value in medians.items():
        sitting.figure(f"{name} per sequence, {shape}", value, "µs", headline=False)
    sitting.write()


if __name__ == "__main__":
    main()
