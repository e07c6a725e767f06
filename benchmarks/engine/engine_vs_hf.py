"""The GPT-2 engine against Hugging Face `generate` on the same weights, in one run.

    python -m benchmarks.engine.engine_vs_hf [--model random-gpt2] [--workloads uniform,mixed] [--device cpu]

For each workload it runs the baselines (HF one request at a time; HF static batches of 8 and 32
with left padding; transformers' own continuous batching manager), this engine in-process with
every request submitted at once, and the same engine as users run it (`served`): a `governor
serve` with its spawned worker configured alike, every request sent at once over TCP by the
asyncio client. It prints generated tokens/s, the ratios (served ÷ in-process among them), the
peak RSS of each run (for `served`: the worker process's) and whether greedy tokens equal HF's.
Then it times decode steps at batch 1/8/32 next to the bare chain of GPT-2's matrix multiplies
at the same shapes, to show how close to the hardware a step is. Tokens/s counts useful tokens:
each request's own `max_new_tokens` (end-of-sequence is ignored everywhere, so every request
generates exactly that many), not the padding rows a static batch keeps computing after its short
requests are done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.common import machine, out_dir, start_governor, stats, stop
from benchmarks.harness.results import Sitting
from benchmarks.harness.workloads import Workload, make_workload
from governor.client import AsyncClient
from govwire.request import GenerateRequest
from worker.allocator import keep_freed_memory
from worker.engine import FinishEvent, LLMEngine
from worker.loading import DTYPES, load, load_hf_model
from worker.scheduler import SchedulerConfig


@dataclass
class RunResult:
    method: str
    seconds: float
    tokens: int
    peak_rss_mib: float
    outputs: list[list[int]] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def peak_rss() -> Iterator[list[float]]:
    """Samples this process's RSS every 20 ms while the block runs; yields [peak] (filled at exit)."""
    box = [_rss_mib()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            box[0] = max(box[0], _rss_mib())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield box
    finally:
        done.set()
        thread.join()
        box[0] = max(box[0], _rss_mib())


def timed(method: str, tokens: int, fn: Callable[..., list[list[int]]], *args: Any) -> RunResult:
    with peak_rss() as peak:
        start = time.perf_counter()
        outputs = fn(*args)
        seconds = time.perf_counter() - start
    return RunResult(method, seconds, tokens, peak[0], outputs)


# -- Hugging Face baselines ---------------------------------------------------------------------------


class HF:
    def __init__(self, model: Any, pad_id: int, device: torch.device) -> None:
        from transformers import GenerationConfig

        self.model = model
        self.pad_id = pad_id
        self.device = device
        # End-of-sequence is ignored by every method, so each request generates exactly its count.
        model.generation_config.eos_token_id = None
        self._config = lambda n: GenerationConfig(
            do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=pad_id
        )

    def sequential(self, ids: list[list[int]], new: list[int]) -> list[list[int]]:
        return self.static(ids, new, batch_size=1)

    @torch.inference_mode()
    def static(self, ids: list[list[int]], new: list[int], batch_size: int) -> list[list[int]]:
        outputs: list[list[int]] = []
        for i in range(0, len(ids), batch_size):
            group, group_new = ids[i : i + batch_size], new[i : i + batch_size]
            width = max(map(len, group))
            input_ids = torch.tensor([[self.pad_id] * (width - len(g)) + g for g in group], device=self.device)
            mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group], device=self.device)
            out = self.model.generate(input_ids, attention_mask=mask, generation_config=self._config(max(group_new)))
            outputs += [row[width : width + n].tolist() for row, n in zip(out, group_new, strict=True)]
        return outputs

    def continuous(self, ids: list[list[int]], new: list[int]) -> list[list[int]]:
        # Not under torch.inference_mode: transformers' manager fails inside it.
        results: dict[str, list[int]] = {}
        with self.model.continuous_batching_context_manager(generation_config=self._config(max(new))) as manager:
            for i, (prompt, n) in enumerate(zip(ids, new, strict=True)):
                manager.add_request(prompt, request_id=str(i), max_new_tokens=n)
            while len(results) < len(ids):
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("transformers' continuous batching returned no result within 600 s")
                if result.is_finished():
                    results[result.request_id] = list(result.generated_tokens)
        return [results[str(i)] for i in range(len(ids))]


# -- this engine ----------------------------------------------------------------------------------------


def run_engine(engine: LLMEngine, prompts: list[str], new: list[int]) -> list[list[int]]:
    seqs = [
        engine.add(GenerateRequest(id=str(i), prompt=p, max_new_tokens=n, temperature=0.0, stop_on_eos=False))
        for i, (p, n) in enumerate(zip(prompts, new, strict=True))
    ]
    while engine.has_work:
        engine.step()
    return [seq.output_ids for seq in seqs]


# -- the same engine behind the governor ------------------------------------------------------------


class Served:
    """A governor with one spawned GPT-2 worker configured like the in-process engine.

    Started once and reused by every workload, like a deployment; its worker is warmed up by the
    first request. `run` sends every request at once over one connection and collects the streamed
    token ids."""

    def __init__(
        self, args: argparse.Namespace, config: SchedulerConfig, *extra_worker_args: str, threads: int = 0
    ) -> None:
        worker_args = (
            "--engine", "gpt2", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
            "--max-batch-size", str(config.max_batch_size),
            "--prefill-max-batch-size", str(config.prefill_max_batch_size),
            "--max-prefill-tokens", str(config.max_prefill_tokens),
            "--kv-cache-tokens", str(config.kv_cache_tokens),
            "--threads", str(threads or args.threads),
            *extra_worker_args,
        )  # fmt: skip
        self.proc, self.port = start_governor(
            "--max-inflight", "1024", worker_args=worker_args, log=out_dir() / "engine_vs_hf_served.log", timeout=600
        )
        self.worker_pid = int(stats(self.port)["workers"][0]["pid"])
        self.run(["warm up"], [2])

    def run(self, prompts: list[str], new: list[int]) -> list[list[int]]:
        return asyncio.run(self._run(prompts, new))

    async def _run(self, prompts: list[str], new: list[int]) -> list[list[int]]:
        async with AsyncClient("127.0.0.1", self.port, timeout=None) as client:

            async def one(prompt: str, n: int) -> list[int]:
                async with client.stream(prompt, max_new_tokens=n, temperature=0.0, stop_on_eos=False) as stream:
                    return [token.token_id async for token in stream]

            return list(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, new, strict=True))))

    def reset_peak_rss(self) -> None:
        """Start a new peak (Linux: writing 5 to clear_refs resets VmHWM)."""
        Path(f"/proc/{self.worker_pid}/clear_refs").write_text("5")

    def rss_mib(self, field: str = "VmRSS") -> float:
        for line in Path(f"/proc/{self.worker_pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {field} for the worker")

    def close(self) -> None:
        stop(self.proc)


def timed_served(served: Served, tokens: int, prompts: list[str], new: list[int]) -> RunResult:
    served.reset_peak_rss()
    start = time.perf_counter()
    outputs = served.run(prompts, new)
    seconds = time.perf_counter() - start
    return RunResult("served", seconds, tokens, served.rss_mib("VmHWM"), outputs)


# -- decode step vs bare matmuls ---------------------------------------------------------------------


def decoding_engine(
    loaded: Any,
    config: SchedulerConfig,
    batch: int,
    steps: int,
    prompt_tokens: int = 64,
    cuda_graphs: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> LLMEngine:
    """`batch` requests (`prompt_tokens`-token prompts; greedy unless a temperature is given) past
    their prefill, with `steps` decode steps to go."""
    engine = LLMEngine.for_model(loaded, config, cuda_graphs=cuda_graphs)
    for i in range(batch):
        engine.add(
            GenerateRequest(
                id=str(i),
                prompt="x" * prompt_tokens,
                max_new_tokens=steps + 3,
                temperature=temperature,
                top_p=top_p,
                seed=i if temperature else None,
                stop_on_eos=False,
            )
        )
    engine.step()  # the prefill
    engine.step()
    return engine


def decode_step_ms(
    loaded: Any,
    config: SchedulerConfig,
    batch: int,
    steps: int = 9,
    prompt_tokens: int = 64,
    cuda_graphs: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> float:
    engine = decoding_engine(loaded, config, batch, steps, prompt_tokens, cuda_graphs, temperature, top_p)
    on_cuda = engine.runner.device.type == "cuda"
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        events = engine.step()  # ends with the .tolist() of the sampled tokens: a synchronisation
        times.append(time.perf_counter() - start)
        assert sum(not isinstance(e, FinishEvent) for e in events) == batch
    if on_cuda:
        torch.cuda.synchronize()
    return statistics.median(times) * 1000


def timed_median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of fn, in ms, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


@torch.inference_mode()
def bare_matmuls_ms(loaded: Any, batch: int, steps: int = 9) -> float:
    """The matrix multiplies of one decode step alone: the model's own linear layers and LM head
    (same weights, layout and library) at the step's shapes, nothing else."""
    model = loaded.model
    param = next(model.parameters())
    x = torch.randn(batch, loaded.shape.n_embd, dtype=param.dtype, device=param.device)
    h = torch.randn(batch, loaded.shape.n_inner, dtype=param.dtype, device=param.device)
    layers = [(blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc, blk.mlp.c_proj) for blk in model.transformer.h]

    def chain() -> None:
        for c_attn, a_proj, c_fc, m_proj in layers:
            c_attn(x)
            a_proj(x)
            c_fc(x)
            m_proj(h)
        model.lm_head(x)
        if param.device.type == "cuda":
            torch.cuda.synchronize()  # time the kernels, not their launches

    return timed_median_ms(chain, steps)


def profile_decode(loaded: Any, config: SchedulerConfig, batch: int = 32, steps: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = decoding_engine(loaded, config, batch, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(f"\n== torch.profiler, {steps} decode steps at batch {batch}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


# -- main ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="engine, worker and HF alike")
    parser.add_argument("--workloads", default="uniform,mixed")
    parser.add_argument(
        "--methods",
        default="hf-sequential,hf-static-8,hf-static-32,hf-continuous,engine,served",
        help="comma-separated subset (hf-sequential is skipped for the mixed workload unless named alone)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="run the methods this many times, in alternation")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--served-threads",
        type=int,
        default=0,
        help="the served worker's --threads (0: --threads); 1 leaves a core to its event loop, the governor"
        " and the client, which a model too small to split across cores needs more",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--step-batches", default="1,8,32", help="decode-step timing at these batch sizes")
    parser.add_argument(
        "--memory-runs",
        type=int,
        default=3,
        help="repeat the last workload on one in-process engine and on the served worker, RSS after each",
    )
    parser.add_argument(
        "--profile", action="store_true", help="print torch.profiler's table for decode steps at batch 32"
    )
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    methods = args.methods.split(",")
    workloads = args.workloads.split(",")
    # One file per workload set, and per dtype and device off the defaults: `make bench-engine` runs
    # uniform and mixed separately, and the bfloat16 runs sit beside the float32 ones.
    off_default = [v for v, default in ((args.dtype, "float32"), (args.device, "cpu")) if v != default]
    if args.served_threads:
        off_default.append(f"served-threads-{args.served_threads}")
    part = "-".join([*workloads, *off_default])
    sitting = Sitting(("govwire", "governor", "worker") if "served" in methods else ("worker",), part=part)

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the worker does, so that in-process and served run alike
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    print(f"machine: {machine()}; torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}")
    import transformers

    print(f"transformers {transformers.__version__}; model {args.model}, {args.dtype}")
    loaded = load(args.model, device, dtype)
    hf_model, tokenizer = load_hf_model(args.model)
    hf = HF(hf_model.to(device=device, dtype=dtype), tokenizer.eos_token_id, device)
    config = SchedulerConfig(
        max_batch_size=args.max_batch_size,
        prefill_max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
    )

    # Warm-up: first calls allocate and pick kernels.
    run_engine(LLMEngine.for_model(loaded, config), ["warm up"], [2])
    hf.static([tokenizer.encode("warm up")], [2], batch_size=1)
    served = Served(args, config, threads=args.served_threads) if "served" in methods else None

    report: dict[str, Any] = {
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "workloads": {},
    }
    try:
        for name in workloads:
            workload = make_workload(name, args.seed)
            report["workloads"][name] = run_workload(
                workload, methods, args.rounds, loaded, hf, tokenizer, config, served
            )
        report["decode_steps"] = decode_steps(loaded, config, args.step_batches)
        if args.memory_runs:
            report["rss_after_runs_mib"] = memory_runs(loaded, config, served, workload, args.memory_runs)
    finally:
        if served is not None:
            served.close()
    if args.profile:
        profile_decode(loaded, config)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    record(sitting, report, args.rounds)
    if sitting.figures:
        sitting.write()
    else:  # one method alone, no decode steps, no memory runs: nothing compared
        print("no comparison was run: no result file written")


def run_workload(
    workload: Workload,
    methods: list[str],
    rounds: int,
    loaded: Any,
    hf: HF,
    tokenizer: Any,
    config: SchedulerConfig,
    served: Served | None,
) -> dict[str, Any]:
    """Every method `rounds` times, in alternation (so each sees the same drift of a shared
    machine); ratios of medians, and served / engine paired by round."""
    name = workload.name
    ids = [tokenizer.encode(p) for p in workload.prompts]
    new = workload.max_new_tokens
    print(
        f"\n== {name}: {len(ids)} requests, {sum(map(len, ids))} prompt tokens "
        f"(lengths {min(map(len, ids))}-{max(map(len, ids))}), {workload.useful_tokens} new tokens "
        f"(per request {min(new)}-{max(new)})"
    )
    if name == "mixed" and len(methods) > 1:  # about 15 minutes on its own
        methods = [m for m in methods if m != "hf-sequential"]
    runs: dict[str, list[RunResult]] = {}
    for _ in range(rounds):
        for method in methods:
            try:
                result = run_method(method, workload, ids, loaded, hf, config, served)
            except Exception as exc:  # a baseline that cannot run here is reported, not fatal
                print(f"  {method:<14} failed: {type(exc).__name__}: {exc}")
                continue
            runs.setdefault(method, []).append(result)
            extra = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.extra.items())
            print(
                f"  {method:<14} {result.seconds:8.2f} s  {result.tok_s:8.1f} tok/s  "
                f"peak RSS {result.peak_rss_mib:7.0f} MiB  {extra}",
                flush=True,
            )
    median = {method: statistics.median(r.tok_s for r in results) for method, results in runs.items()}
    if rounds > 1:
        print("  medians: " + ", ".join(f"{m} {v:.1f} tok/s" for m, v in median.items()))
    identical: dict[str, int] = {}  # "subject/method": requests whose greedy tokens are equal
    for subject in ("engine", "served"):
        if subject not in runs:
            continue
        mine = runs[subject][0]
        for method, results in runs.items():
            if method in ("engine", "served"):
                continue
            same = sum(a == b for a, b in zip(mine.outputs or [], results[0].outputs or [], strict=False))
            identical[f"{subject}/{method}"] = same
            print(
                f"  {subject} / {method:<14} = {median[subject] / median[method]:5.2f}x   "
                f"greedy outputs identical: {same}/{len(ids)}"
            )
    paired: list[float] = []
    if "engine" in runs and "served" in runs:
        paired = [s.tok_s / e.tok_s for e, s in zip(runs["engine"], runs["served"], strict=False)]
        same = sum(
            a == b for a, b in zip(runs["served"][0].outputs or [], runs["engine"][0].outputs or [], strict=True)
        )
        identical["served/engine"] = same
        print(
            f"  served / engine        = {statistics.median(paired):5.2f}x (paired by round: "
            + ", ".join(f"{r:.2f}" for r in paired)
            + f")   greedy outputs identical: {same}/{len(ids)}"
        )
    return {
        "requests": len(ids),
        "prompt_tokens": sum(map(len, ids)),
        "new_tokens": workload.useful_tokens,
        "median_tok_s": median,
        "served_over_engine_by_round": paired,
        "greedy_identical": identical,
        "results": [
            {"method": r.method, "seconds": r.seconds, "tok_s": r.tok_s, "peak_rss_mib": r.peak_rss_mib, **r.extra}
            for results in runs.values()
            for r in results
        ],
    }


LABELS = {
    "hf-sequential": "HF generate, one at a time",
    "hf-continuous": "HF continuous batching",
    "engine": "engine in-process",
    "served": "served",
}


def label(method: str) -> str:
    """A method as a newcomer reads it in a figure's name."""
    if method.startswith("hf-static-"):
        return f"HF generate, static batch {method.rsplit('-', 1)[1]}"
    return LABELS[method]


# The targets for the served path (docs/benchmarks/sittings.md, section 5): (workload, method) -> bar.
SERVED_BARS = {("uniform", "hf-static-32"): 1.5, ("mixed", "hf-continuous"): 4.0, ("wide", "hf-static-256"): 1.0}
SERVED_OVER_ENGINE_BAR = 0.95
# A decode step at batch 32 against its bare matmuls, by dtype (float32: the target;
# bfloat16: issue 35's).
STEP_BARS = {"float32": 1.1, "bfloat16": 2.0}


def record(sitting: Sitting, report: dict[str, Any], rounds: int) -> None:
    """The printed comparisons as figures: served and in-process against every baseline run (ratios
    of medians, as printed), served against in-process (median of the per-round ratios), the decode
    steps against their bare matmuls, RSS over repeated runs; the whole report as details."""
    dtype = report["dtype"]
    cached = "rounds after the first reuse the served worker's prefix cache; per-round tok/s in details"
    for workload, data in report["workloads"].items():
        median, same, requests = data["median_tok_s"], data["greedy_identical"], data["requests"]
        baselines = [m for m in median if m not in ("engine", "served")]
        for subject in (s for s in ("served", "engine") if s in median):
            for method in baselines:
                bar = SERVED_BARS.get((workload, method)) if subject == "served" else None
                ratio = median[subject] / median[method]
                note = f"greedy outputs identical: {same[f'{subject}/{method}']}/{requests}"
                sitting.figure(
                    f"{label(subject)} vs {label(method)}, {workload}, {dtype}",
                    median[subject],
                    "tok/s",
                    baseline=(label(method), median[method]),
                    bar=None if bar is None else f">= {bar:g}x",
                    met=None if bar is None else ratio >= bar,
                    headline=bar is not None,
                    note=note + (f"; {cached}" if subject == "served" and rounds > 1 else ""),
                )
        if paired := data["served_over_engine_by_round"]:
            ratio = statistics.median(paired)
            sitting.figure(
                f"served vs engine in-process, {workload}, {dtype}",
                median["served"],
                "tok/s",
                baseline=(label("engine"), median["engine"]),
                ratio=ratio,
                bar=f">= {SERVED_OVER_ENGINE_BAR:g}x",
                met=ratio >= SERVED_OVER_ENGINE_BAR,
                note=f"median of the per-round ratios; greedy outputs identical: {same['served/engine']}/{requests}",
            )
    for batch, step in report.get("decode_steps", {}).items():
        bar = STEP_BARS.get(dtype) if batch == 32 else None
        ratio = step["step_ms"] / step["bare_matmuls_ms"]
        sitting.figure(
            f"decode step, batch {batch}, {dtype}",
            step["step_ms"],
            "ms",
            baseline=("bare matmuls, same shapes", step["bare_matmuls_ms"]),
            bar=None if bar is None else f"<= {bar:g}x",
            met=None if bar is None else ratio <= bar,
            headline=batch == 32,
        )
    last = list(report["workloads"])[-1]  # what memory_runs repeats
    for key, name in (("engine", "benchmark process RSS"), ("served_worker", "served worker RSS")):
        if rss := report.get("rss_after_runs_mib", {}).get(key):
            sitting.figure(
                f"{name} after {len(rss)} runs of {last}, {dtype}",
                rss[-1],
                "MiB",
                baseline=("after the first", rss[0]),
                bar="no growth",
                met=round(rss[-1]) <= round(rss[0]),  # in whole MiB, as printed
                headline=False,
            )
    sitting.details = report


def run_method(
    method: str,
    workload: Workload,
    ids: list[list[int]],
    loaded: Any,
    hf: HF,
    config: SchedulerConfig,
    served: Served | None,
) -> RunResult:
    new, tokens = workload.max_new_tokens, workload.useful_tokens
    if method == "hf-sequential":
        return timed(method, tokens, hf.sequential, ids, new)
    if method.startswith("hf-static-"):
        return timed(method, tokens, hf.static, ids, new, int(method.rsplit("-", 1)[1]))
    if method == "hf-continuous":
        return timed(method, tokens, hf.continuous, ids, new)
    if method == "engine":
        engine = LLMEngine.for_model(loaded, config)
        result = timed(method, tokens, run_engine, engine, workload.prompts, new)
        result.extra["kv_cache_mib"] = engine.runner.cache.nbytes / 2**20
        result.extra["steps"] = engine.counters.steps
        result.extra["mean_batch"] = engine.counters.step_sequences / max(1, engine.counters.steps)
        return result
    if method == "served" and served is not None:
        return timed_served(served, tokens, workload.prompts, new)
    raise SystemExit(f"unknown method {method!r}")


def decode_steps(loaded: Any, config: SchedulerConfig, batches: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    if not batches:
        return steps
    print("\n== decode step (median of 9) vs the bare matmul chain of the same shapes")
    for batch in map(int, batches.split(",")):
        step = decode_step_ms(loaded, config, batch)
        bare = bare_matmuls_ms(loaded, batch)
        steps[batch] = {"step_ms": step, "bare_matmuls_ms": bare}
        print(f"  batch {batch:3d}: step {step:7.1f} ms   bare matmuls {bare:7.1f} ms   ratio {step / bare:4.2f}")
    return steps


def memory_runs(
    loaded: Any, config: SchedulerConfig, served: Served | None, workload: Workload, runs: int
) -> dict[str, list[float]]:
    """One engine (and the one served worker), the same workload again and again: the KV cache is
    allocated once, so RSS should not grow from run to run."""
    engine = LLMEngine.for_model(loaded, config)
    rss: dict[str, list[float]] = {"engine": [], "served_worker": [], "served_worker_peak": []}
    for _ in range(runs):
        run_engine(engine, workload.prompts, workload.max_new_tokens)
        rss["engine"].append(_rss_mib())
        if served is not None:
            served.reset_peak_rss()
            served.run(workload.prompts, workload.max_new_tokens)
            rss["served_worker"].append(served.rss_mib())
            rss["served_worker_peak"].append(served.rss_mib("VmHWM"))
    print(f"\n== RSS after each of {runs} runs of {workload.name}")
    for key, values in rss.items():
        if values:
            print(f"  {key:<20} " + ", ".join(f"{r:.0f}" for r in values) + " MiB")
    return rss


if __name__ == "__main__":
    main()
