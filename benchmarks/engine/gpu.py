"""The engine on a GPU: tokens/s at batch 1/32/256 against HF `generate`, the decode step against its
bare matmuls and its kernel launches, with and without CUDA graphs, and memory.

    python -m benchmarks.engine.gpu [--dtype bfloat16] [--batches 1,32,256] [--model random-gpt2]

For each batch B: B requests of 64-token prompts and 64 new tokens (greedy, no EOS stop), run by
HF `generate` as one static batch and by the engine (`--max-batch-size` B), with overlapped steps
(`--async-scheduling on`, the default on CUDA) and without, in the same dtype on the same GPU;
tokens/s of each and the ratios. Then the decode step at batch 32: its median time
with graphs and eagerly next to the bare matmul chain of the same shapes (synchronised), and the
kernel launches of one step counted by torch.profiler. Then peak GPU memory. Then, with
`--served-batch` B (default 256; 0 skips it), the engine as users run it: a governor with a spawned
worker (`--max-batch-size` B), B streams of 64-token prompts and 64 new tokens sent at once over
TCP, best of three, with `--async-scheduling on` and `off` (issue 45's served target: 2x the 16,634
tok/s an H200 served at batch 256 before overlapped steps). With `--device cpu` the same code runs
on the CPU (no launch counts): that is how it is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.engine_vs_hf import HF, Served, bare_matmuls_ms, decode_step_ms, decoding_engine, run_engine
from benchmarks.harness.common import machine
from benchmarks.harness.results import Sitting
from worker.engine import LLMEngine
from worker.loading import DTYPES, load, load_hf_model
from worker.scheduler import SchedulerConfig

PROMPT_TOKENS = 64
NEW_TOKENS = 64
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def throughput(loaded: Any, hf: HF, tokenizer: Any, batch: int, device: torch.device) -> dict[str, float]:
    prompts = [f"{i:04d} " + "x" * (PROMPT_TOKENS - 5) for i in range(batch)]
    ids = [tokenizer.encode(p) for p in prompts]
    new = [NEW_TOKENS] * batch
    rows = batch * (PROMPT_TOKENS + NEW_TOKENS)
    config = SchedulerConfig(max_batch_size=batch, prefill_max_batch_size=batch, kv_cache_tokens=rows)
    # On CUDA each captures its decode graphs.
    engines = {
        name: LLMEngine.for_model(loaded, config, overlap=name == "engine") for name in ("engine", "engine_sync")
    }
    for engine in engines.values():
        run_engine(engine, prompts[:1], [2])
    hf.static(ids[:1], [2], batch_size=1)
    runs = {name: (lambda e=engine: run_engine(e, prompts, new)) for name, engine in engines.items()}
    runs["hf"] = lambda: hf.static(ids, new, batch)
    timings = {}
    for name, run in runs.items():
        synchronize(device)
        start = time.perf_counter()
        timings[name] = (run(), time.perf_counter() - start)
    (ours, engine_s), (sync, sync_s), (theirs, hf_s) = timings["engine"], timings["engine_sync"], timings["hf"]
    assert ours == sync, "overlapped and synchronous steps must give the same tokens"
    return {
        "engine_tok_s": batch * NEW_TOKENS / engine_s,
        "engine_sync_tok_s": batch * NEW_TOKENS / sync_s,
        "hf_tok_s": batch * NEW_TOKENS / hf_s,
        "ratio": hf_s / engine_s,
        "sync_ratio": hf_s / sync_s,
        "greedy_identical": sum(a == b for a, b in zip(ours, theirs, strict=True)) / batch,
    }


def served_tok_s(args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Best-of-three tok/s of `batch` streams sent at once through a governor, per --async-scheduling."""
    prompts = [f"{i:04d} " + "x" * (PROMPT_TOKENS - 5) for i in range(batch)]
    new = [NEW_TOKENS] * batch
    config = SchedulerConfig(
        max_batch_size=batch,
        prefill_max_batch_size=batch,
        max_prefill_tokens=batch * PROMPT_TOKENS,
        kv_cache_tokens=batch * (PROMPT_TOKENS + NEW_TOKENS),
    )
    result = {}
    for mode in ("on", "off"):
        served = Served(args, config, "--async-scheduling", mode)
        try:
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                served.run(prompts, new)
                best = max(best, batch * NEW_TOKENS / (time.perf_counter() - start))
        finally:
            served.close()
        result[f"async_{mode}_tok_s"] = best
    return result


def launches_per_step(loaded: Any, config: SchedulerConfig, cuda_graphs: bool) -> int:
    from torch.profiler import ProfilerActivity, profile

    engine = decoding_engine(loaded, config, 32, 4, cuda_graphs=cuda_graphs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)


def record(sitting: Sitting, report: dict[str, Any]) -> None:
    """The printed rows as figures, each named with its dtype (the GPU is the result's machine): the
    engine against HF `generate` at every batch, the largest batch the headline; the decode step
    against its bare matmuls, its launches, peak memory; the whole report as details."""
    dtype = report["dtype"]
    largest = max(report["throughput"])
    for batch, row in report["throughput"].items():
        # Overlapped steps (the default on CUDA) and synchronous ones give the same tokens.
        for mode, key, headline in (
            ("engine", "", batch == largest),
            ("engine without overlapped steps", "sync_", False),
        ):
            sitting.figure(
                f"{mode}, batch {batch}, {dtype}",
                row[f"engine_{key}tok_s"],
                "tok/s",
                baseline=(f"HF generate, static batch {batch}", row["hf_tok_s"]),
                ratio=row[f"{key}ratio"],
                headline=headline,
                note=f"greedy outputs identical to HF's: {row['greedy_identical']:.0%}",
            )
    step = report["decode_step_b32"]
    for label in ("graphs", "eager"):
        if f"{label}_ms" in step:
            sitting.figure(
                f"decode step, batch 32, {label}, {dtype}",
                step[f"{label}_ms"],
                "ms",
                baseline=("bare matmuls, same shapes", step["bare_matmuls_ms"]),
                headline=False,
            )
        if f"{label}_launches" in step:
            name = f"kernel launches per decode step, batch 32, {label}, {dtype}"
            sitting.figure(name, step[f"{label}_launches"], "launches", headline=False)
    if "peak_memory_gib" in report:
        sitting.figure(f"peak GPU memory allocated, {dtype}", report["peak_memory_gib"], "GiB", headline=False)
    if "served" in report:
        served = report["served"]
        sitting.figure(
            f"served, {served['batch']} streams, overlapped steps, {dtype}",
            served["async_on_tok_s"],
            "tok/s",
            baseline=("served, synchronous steps", served["async_off_tok_s"]),
            headline=False,
        )
    sitting.details = report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-gpt2")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument(
        "--served-batch", type=int, default=256, help="streams sent at once through a governor; 0: skip"
    )
    parser.add_argument("--threads", type=int, default=0, help="the served worker's --threads (0: torch's default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sitting = Sitting(("govwire", "governor", "worker") if args.served_batch else ("worker",))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    name = torch.cuda.get_device_name() if device.type == "cuda" else machine()
    print(f"device: {name}; torch {torch.__version__}; model {args.model}, {args.dtype}")
    loaded = load(args.model, device, dtype)
    hf_model, tokenizer = load_hf_model(args.model)
    hf = HF(hf_model.to(device=device, dtype=dtype), tokenizer.eos_token_id, device)
    report: dict[str, Any] = {"device": name, "dtype": args.dtype, "throughput": {}}

    print(f"\n== {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens each, one batch")
    for batch in map(int, args.batches.split(",")):
        row = report["throughput"][batch] = throughput(loaded, hf, tokenizer, batch, device)
        print(
            f"  batch {batch:4d}: engine {row['engine_tok_s']:9.1f} tok/s (synchronous {row['engine_sync_tok_s']:9.1f})"
            f"   HF generate {row['hf_tok_s']:9.1f} tok/s   engine / HF {row['ratio']:5.2f}x"
            f" (synchronous {row['sync_ratio']:5.2f}x)   greedy identical {row['greedy_identical']:.0%}",
            flush=True,
        )

    config = SchedulerConfig(max_batch_size=32, kv_cache_tokens=32 * 256)
    step: dict[str, float] = {"bare_matmuls_ms": bare_matmuls_ms(loaded, 32)}
    for graphs in (True, False) if device.type == "cuda" else (False,):
        label = "graphs" if graphs else "eager"
        step[f"{label}_ms"] = decode_step_ms(loaded, config, 32, cuda_graphs=graphs)
        if device.type == "cuda":
            step[f"{label}_launches"] = launches_per_step(loaded, config, graphs)
    report["decode_step_b32"] = step
    print("\n== decode step at batch 32 (median of 9)")
    print("  " + "   ".join(f"{k} {v:.2f}" for k, v in step.items()))
    if device.type == "cuda":
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"\n== peak GPU memory allocated: {report['peak_memory_gib']:.2f} GiB")
    if args.served_batch:
        served = report["served"] = {"batch": args.served_batch, **served_tok_s(args, args.served_batch)}
        print(
            f"\n== served, {args.served_batch} streams at once: overlapped steps {served['async_on_tok_s']:.1f} tok/s,"
            f" synchronous {served['async_off_tok_s']:.1f} tok/s"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    record(sitting, report)
    sitting.write()


if __name__ == "__main__":
    main()
