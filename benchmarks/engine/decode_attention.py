"""The CPU decode-attention kernel, one layer's call, at the head dims the worker serves, beside torch.

    python -m benchmarks.engine.decode_attention [--threads 2] [--calls 400] [--baseline-tree DIR]

Shapes: GPT-2 small (12 heads of 64) and the trained model (4 heads of 64) at batch 32, random-tiny
(4 heads of 16) at batch 256; contexts of up to 64 and 256 tokens (each sequence's length drawn
from [L/2, L]) in blocks of 16 scattered over the arena; the KV cache in float32 and bfloat16.
Each case twice: warm (the arena as the last call left it in the caches) and cold (64 MiB written
before every call, as a served step's weights pass through the caches between two layers'
attention). Per case, on the same arena and queries:

- the C kernel (worker/kernels/decode_attention.c, what the worker runs on the CPU);
- with `--baseline-tree DIR` (a checkout of an earlier commit, e.g. a `git worktree`), the kernel
  built from that tree's source, its calls alternating with this one's (each leading in turn), so
  that the machine's drift and the caches fall on both alike: a change to the kernel measured
  against what it replaced;
- torch's `GatherDecode` (worker/attention.py: the block tables mapped to a padded row index, the
  context gathered and SDPA run under a length mask), the worker's path where no C compiler is,
  timed on its own after the kernels.

Median µs per call, ns per key and head (the kernel's), and the ratios of the others' times to the
kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.harness.common import machine, markdown_table
from benchmarks.harness.results import Sitting, baseline_tree
from worker.attention import GatherDecode
from worker.kernels.build import build
from worker.kernels.decode_attention import SOURCE, DecodeAttentionKernel

BLOCK = 16
SHAPES = {  # name: (batch, heads, head dim)
    "GPT-2 small": (32, 12, 64),
    "trained": (32, 4, 64),
    "random-tiny": (256, 4, 16),
}
CONTEXTS = (64, 256)
DTYPES = (torch.float32, torch.bfloat16)
# On the page: the longer context, cold, in the KV dtype each model is served with by default
# (GPT-2 small with --quantize int8 on a CPU with native bfloat16, random-tiny in float32).
HEADLINES = {
    "GPT-2 small (12 heads of 64), batch 32, context <= 256, bfloat16 KV, cold",
    "random-tiny (4 heads of 16), batch 256, context <= 256, float32 KV, cold",
}


FLUSH_BYTES = 64 * 2**20


def timed(runs: dict[str, Callable[[], None]], calls: int, flush: torch.Tensor | None) -> dict[str, float]:
    """Median seconds per call of each run, the runs alternating (each leading in turn); `flush`:
    written before every call."""
    spent: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(calls + 10):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            if flush is not None:
                flush.fill_(i)
            started = time.perf_counter()
            runs[name]()
            if i >= 10:  # the first calls warm the thread team
                spent[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in spent.items()}


def case(
    kernels: dict[str, DecodeAttentionKernel],
    shape: tuple[int, int, int],
    context: int,
    dtype: torch.dtype,
    calls: int,
    flush: torch.Tensor | None,
) -> dict[str, float]:
    """Median seconds per call of each kernel and of GatherDecode, and the keys read per call."""
    batch, heads, dim = shape
    g = torch.Generator().manual_seed(context * dim + heads)
    width = -(-context // BLOCK)
    blocks = batch * width * 2  # scattered: every other block of the arena unused
    keys, values = (torch.randn(heads, blocks * BLOCK, dim, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(blocks, generator=g)[: batch * width].view(batch, width).contiguous()
    lens = torch.randint(context // 2, context + 1, (batch,), generator=g)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    out = torch.empty_like(q)
    rows, scale = torch.arange(batch), dim**-0.5
    runs: dict[str, Callable[[], None]] = {}
    for name, kernel in kernels.items():
        step = kernel.prepare(rows, tables, lens, BLOCK, scale)
        runs[name] = lambda step=step: step(q, keys, values, out)
    gather = GatherDecode(rows, tables, lens, context, BLOCK, scale)
    torch_run = {"torch GatherDecode": lambda: gather(q, q, q, keys, values, out)}
    return {**timed(runs, calls, flush), **timed(torch_run, calls, flush), "keys": float(lens.sum() * heads)}


def record(sitting: Sitting, title: str, t: dict[str, float], baseline: str | None) -> list[str]:
    """One case's figures, and its row of the table."""
    mine = t["kernel"]
    others = {name: t[name] / mine for name in t if name not in ("kernel", "keys")}
    gather = t["torch GatherDecode"]
    sitting.figure(
        f"decode attention per layer call, {title}",
        mine * 1e6,
        "µs",
        baseline=("torch GatherDecode", gather * 1e6),
        ratio=gather / mine,
        headline=title in HEADLINES and baseline is None,
        note="ratio: the baseline's time over the kernel's (above 1: the kernel is faster)",
    )
    if baseline is not None:
        before = t[f"kernel {baseline}"]
        sitting.figure(
            f"decode attention per layer call against the kernel {baseline}, {title}",
            mine * 1e6,
            "µs",
            baseline=(f"kernel {baseline}", before * 1e6),
            ratio=before / mine,
            headline=title in HEADLINES,
            note="ratio: the baseline's time over the kernel's, their calls alternating in one process",
        )
    return [title, f"{mine * 1e6:,.1f}", f"{mine * 1e9 / t['keys']:.2f}", *(f"{r:.2f}x" for r in others.values())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--baseline-tree", help="a checkout whose kernel source runs beside this one's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    baseline = baseline_tree(args.baseline_tree)
    kernels = {"kernel": DecodeAttentionKernel(build(SOURCE))}
    if baseline is not None:
        source = baseline[1] / SOURCE.relative_to(SOURCE.parents[2])
        kernels[f"kernel {baseline[0]}"] = DecodeAttentionKernel(build(source))
    sitting = Sitting(("worker",), part="baseline" if baseline else None)
    print(f"{machine()}; kernel isa {kernels['kernel'].isa}; {args.threads} threads; median of {args.calls} calls")
    rows = []
    flush = torch.empty(FLUSH_BYTES // 4)
    for label, (batch, heads, dim) in SHAPES.items():
        for context in CONTEXTS:
            for dtype in DTYPES:
                for cold in (False, True):
                    kv = str(dtype).removeprefix("torch.")
                    t = case(kernels, (batch, heads, dim), context, dtype, args.calls, flush if cold else None)
                    title = f"{label} ({heads} heads of {dim}), batch {batch}, context <= {context}, {kv} KV, "
                    title += "cold" if cold else "warm"
                    rows.append(record(sitting, title, t, baseline[0] if baseline else None))
    headers = ["case", "kernel µs", "ns per key-head", *(f"{name} ÷ kernel" for name in kernels if name != "kernel")]
    print(markdown_table([*headers, "torch GatherDecode ÷ kernel"], rows))
    sitting.write()


if __name__ == "__main__":
    main()
