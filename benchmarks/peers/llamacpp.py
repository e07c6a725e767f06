"""llama.cpp's server beside the governor's served GPT-2: same CPU, model, dtype, threads, workloads.

    python -m benchmarks.peers.llamacpp [--dtypes float32,bfloat16,int8] [--workloads uniform,mixed] [--rounds 3]
        [--sampling greedy,nucleus] [--model random|trained]
    make bench-llamacpp

1. llama.cpp's source: the llama-cpp-python source distribution from PyPI (it vendors llama.cpp
   whole, with its `convert_hf_to_gguf.py`), downloaded once into benchmarks/out/llamacpp/.
2. `llama-server` built from it with CMake (Ninja where present; `GGML_NATIVE`: this CPU's own
   vector instructions; no network features): about 6 minutes on 2 cores, once.
3. The benchmark model (`python -m benchmarks.harness.model_dir`: GPT-2 small, seeded random weights, a
   50,257-entry BPE) converted to GGUF for each dtype (benchmarks/harness/gguf_convert.py), once.
4. For each dtype and round, alternating which goes first: `llama-server --parallel 32
   --cont-batching` and the governor's front door (`--http-port`) in front of a GPT-2 worker, each
   with `--threads` threads, are sent engine_vs_hf's workload (benchmarks/harness/workloads.py; uniform:
   32 × 64-character prompts, 64 new tokens; mixed: 16–512 characters, 8–128 new tokens) all at once
   on `/v1/completions`: greedy, `ignore_eos`, not streamed, and no prompt cache on either side
   (`cache_prompt: false` to llama-server, `--no-prefix-caching` to the worker) so every round is
   a first round. Tokens/s = completion tokens / the wall time from the first send to the last
   reply; the median over rounds, and the governor / llama-server ratio.
5. For each served round, the share of its wall time the worker's engine spent in steps (its
   `busy_seconds_total`, pushed every 0.2 s): what is left is time outside the steps (serving,
   the front door, the HTTP client sharing the cores).
6. `--sampling nucleus`: the same rounds sampled as OpenAI clients ask by default, temperature 1
   and top_p 0.9 (llama-server also told `top_k: 0, min_p: 0`, its other default filters, so
   both draw from the same set; at temperature 1 its order of filters does not matter), beside
   greedy: the governor's sampled / greedy tokens/s too. Random weights give flat distributions,
   whose top-p set is most of the vocabulary (the worst case for a sampler); `--model trained`
   (benchmarks/harness/model_dir.py --trained: a 4-layer GPT-2 trained for 10 minutes, 8,192
   tokens) gives peaked ones, as a real model's are.

Where CMake or a C++ compiler is missing it says so and exits 0: it is never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx

from benchmarks.harness import rounds
from benchmarks.harness.common import (
    HARNESS,
    ROOT,
    free_port,
    machine,
    markdown_table,
    out_dir,
    start_front_door,
    stats,
    stop,
)
from benchmarks.harness.model_dir import ensure as ensure_model_dir
from benchmarks.harness.model_dir import ensure_trained
from benchmarks.harness.results import Sitting
from benchmarks.harness.workloads import Workload, make_workload

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp 0c1e570 (release b11312)
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}
"""The GGUF type llama-server runs for each dtype: `int8` is the worker's `--quantize int8`
(float32 otherwise) against Q8_0, the int8 format CPU users run (the converter writes it)."""
# Each side's request fields for a way of sampling (on top of greedy's, in `drive`).
SAMPLING: dict[str, dict[str, dict[str, Any]]] = {
    "greedy": {"llama-server": {}, "governor": {}},
    "nucleus": {
        "llama-server": {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0},
        "governor": {"temperature": 1.0, "top_p": 0.9},
    },
}


def missing_tools() -> list[str]:
    return [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]


def llama_source(work: Path) -> Path:
    """llama.cpp's tree inside the sdist, downloaded and unpacked once."""
    trees = sorted(work.glob("src/llama_cpp_python-*/vendor/llama.cpp"))
    if trees:
        return trees[-1]
    dl = work / "dl"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(dl), SDIST],
        check=True,
    )
    (archive,) = dl.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "src", filter="data")
    return sorted(work.glob("src/llama_cpp_python-*/vendor/llama.cpp"))[-1]


def llama_server(work: Path, source: Path) -> Path:
    """The llama-server binary, built once (configured from the tree's real path: through a
    symlink its build loops on the submodule's git index)."""
    binary = work / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # else it tries to download its web UI
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    build = work / "build"
    print(f"building llama-server into {build} (about 6 minutes on 2 cores, once)", flush=True)
    subprocess.run(["cmake", "-S", str(source.resolve()), "-B", str(build), *generator, *flags], check=True)
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "--build", str(build), "-j", jobs, "--target", "llama-server"], check=True)
    return binary


def gguf(work: Path, source: Path, model_dir: Path, dtype: str) -> Path:
    out = work / "models" / f"{model_dir.name}-{GGUF_TYPES[dtype]}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        converter = HARNESS / "gguf_convert.py"
        argv = [sys.executable, str(converter), str(source), str(model_dir), "--outtype", GGUF_TYPES[dtype]]
        log = work / f"convert-{GGUF_TYPES[dtype]}.log"
        with log.open("wb") as sink:
            done = subprocess.run([*argv, "--outfile", str(partial)], stdout=sink, stderr=subprocess.STDOUT)
        if done.returncode:
            raise RuntimeError(f"converting {model_dir} to GGUF failed: see {log}")
        partial.rename(out)
    return out


async def drive(url: str, workload: Workload, extra: dict[str, Any]) -> tuple[int, float]:
    """Every request at once; (completion tokens, seconds from the first send to the last reply)."""

    async def one(client: httpx.AsyncClient, prompt: str, new: int) -> int:
        body = {"model": "gpt2", "prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True}
        reply = await client.post(url, json={**body, **extra})
        reply.raise_for_status()
        usage = reply.json()["usage"]
        if usage["completion_tokens"] != new:
            raise RuntimeError(f"asked for {new} tokens, got {usage['completion_tokens']}")
        return int(usage["completion_tokens"])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, "warm up", 2)
        start = time.perf_counter()
        tokens = await asyncio.gather(
            *(one(client, p, n) for p, n in zip(workload.prompts, workload.max_new_tokens, strict=True))
        )
        return sum(tokens), time.perf_counter() - start


def launch_openai_server(
    argv: list[str],
    log: Path,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
    name: str = "llama-server",
) -> tuple[Popen[bytes], int]:
    """An OpenAI-compatible server (llama-server, or vLLM's: both take --host and --port and answer
    /health) run as `argv` on a free loopback port, under `prefix` (taskset, say), with `env` added
    to this environment, its output in `log`: (process, port) once its /health answers, within 5 min."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        proc = Popen(
            [*prefix, *argv, "--host", "127.0.0.1", "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{name} did not start: see {log}")
        time.sleep(0.5)


def start_llama(binary: Path, model: Path, threads: int) -> tuple[Popen[bytes], int]:
    argv = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "--parallel", "32"]
    argv += ["--cont-batching", "-c", str(32 * 1024)]
    return launch_openai_server(argv, out_dir() / "llamacpp" / "llama-server.log")


STATS_INTERVAL_S = 0.2  # the served worker pushes its engine's counters this often


def start_served(
    model_dir: Path, dtype: str, threads: int, *extra_worker_args: str, tree: Path = ROOT
) -> tuple[Popen[bytes], int, int]:
    """The governor with its worker, from `tree`: (process, HTTP port, NDJSON port for `stats`)."""
    dtypes = ("--dtype", "float32", "--quantize", "int8") if dtype == "int8" else ("--dtype", dtype)
    worker = ("--engine", "gpt2", "--model", str(model_dir), *dtypes, "--threads", str(threads), *extra_worker_args)
    worker += ("--max-batch-size", "32", "--no-prefix-caching", "--stats-interval-s", str(STATS_INTERVAL_S))
    log = out_dir() / "llamacpp" / "governor.log"
    gov, port, http = start_front_door("--max-inflight", "1024", worker_args=worker, log=log, timeout=600, cwd=tree)
    return gov, http, port


def engine_busy_s(port: int) -> float:
    """The served worker's engine time in steps so far (its last push)."""
    return float(stats(port)["workers"][0]["engine"]["busy_seconds_total"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default="uniform,mixed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sampling", default="greedy", help="greedy, nucleus or both (comma-separated)")
    p.add_argument("--model", choices=("random", "trained"), default="random")
    a = p.parse_args()
    # The default run keeps its own result file; another model or sampling writes a part beside it.
    default = (a.model, a.sampling) == ("random", "greedy")
    part = None if default else f"{a.model}-{a.sampling.replace(',', '-')}"
    if "int8" in a.dtypes.split(","):  # the int8 sitting keeps its own file beside the float one
        part = "int8" if part is None else f"{part}-int8"
    sitting = Sitting(("govwire", "governor", "worker"), part=part)
    missing = missing_tools()
    if missing:
        print(f"skipped: {', '.join(missing)} not found (install CMake and a C++ compiler to build llama.cpp)")
        return
    work = out_dir() / "llamacpp"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model_dir() if a.model == "random" else ensure_trained()
    source = llama_source(work)
    binary = llama_server(work, source)
    print(f"machine: {machine()}; llama.cpp from {SDIST}; {a.threads} threads each; model {model_dir.name}")
    rows = []
    for dtype in a.dtypes.split(","):
        model = gguf(work, source, model_dir, dtype)
        for name in a.workloads.split(","):
            workload = make_workload(name, 0)
            ours_by_sampling: dict[str, float] = {}
            for sampling in a.sampling.split(","):
                ours, theirs, paired, in_steps = compare(a, binary, model, model_dir, dtype, workload, sampling)
                ours_by_sampling[sampling] = ours
                case = f"{dtype}, {name} workload" + ("" if sampling == "greedy" else f", {sampling} sampling")
                case += "" if a.model == "random" else ", trained model"
                # The bars: >= 2x for the default run's greedy uniform rounds, ahead of llama-server
                # for sampled ones (the headline of a run with them); a greedy run beside a sampled
                # one is its reference, no figure of its own.
                sampled = sampling != "greedy"
                uniform = name == "uniform" and not sampled and default
                sitting.figure(
                    f"served tok/s, {case}",
                    ours,
                    "tok/s",
                    baseline=("llama-server", theirs),
                    bar=">= 2.0x" if uniform else ("> 1.0x" if sampled else None),
                    met=ours / theirs >= 2.0 if uniform else (ours > theirs if sampled else None),
                    headline=default or sampled,
                )
                sitting.figure(
                    f"served round's wall time in engine steps, {case}",
                    statistics.median(in_steps),
                    "share",
                    headline=False,
                    note="the engine's busy_seconds_total over the round; the rest is outside the steps",
                )
                sitting.details[case] = {"paired_by_round": paired, "in_engine_steps_by_round": in_steps}
                rows.append([dtype, name, sampling, f"{theirs:,.1f}", f"{ours:,.1f}", f"{ours / theirs:.2f}x"])
                rows[-1].append(", ".join(f"{x:.2f}" for x in paired))
            if "greedy" in ours_by_sampling and "nucleus" in ours_by_sampling:
                sitting.figure(
                    f"governor's sampled / greedy tok/s, {dtype}, {name} workload"
                    + ("" if a.model == "random" else ", trained model"),
                    ours_by_sampling["nucleus"] / ours_by_sampling["greedy"],
                    "ratio",
                    bar=">= 0.9",
                    met=ours_by_sampling["nucleus"] / ours_by_sampling["greedy"] >= 0.9,
                    note="temperature 1, top_p 0.9 against greedy, medians of the rounds above",
                )
    print()
    headers = ["dtype", "workload", "sampling", "llama-server tok/s", "governor tok/s", "ratio", "paired by round"]
    print(markdown_table(headers, rows))
    sitting.write()


def compare(
    a: argparse.Namespace, binary: Path, model: Path, model_dir: Path, dtype: str, workload: Workload, sampling: str
) -> tuple[float, float, list[float], list[float]]:
    """Rounds of one workload, sampled one way, on each side in turn: (the governor's median
    tok/s, llama-server's, the governor / llama-server ratio of each round, and each served
    round's share of its wall time in engine steps)."""
    results: dict[str, list[float]] = {"llama-server": [], "governor": []}
    in_steps: list[float] = []
    for r in range(a.rounds):
        for side in rounds.order(r, ("llama-server", "governor")):
            stats_port = 0
            if side == "llama-server":
                proc, port = start_llama(binary, model, a.threads)
            else:
                proc, port, stats_port = start_served(model_dir, dtype, a.threads)
            try:
                busy = engine_busy_s(stats_port) if stats_port else 0.0
                extra = ({"cache_prompt": False} if side == "llama-server" else {}) | SAMPLING[sampling][side]
                tokens, seconds = asyncio.run(drive(f"http://127.0.0.1:{port}/v1/completions", workload, extra))
                if stats_port:
                    time.sleep(2 * STATS_INTERVAL_S)  # the push that counts the round's last step
                    in_steps.append((engine_busy_s(stats_port) - busy) / seconds)
            finally:
                stop(proc)
            results[side].append(tokens / seconds)
            share = f", {in_steps[-1]:.0%} of it in engine steps" if stats_port else ""
            print(
                f"{dtype} {workload.name} {sampling} round {r + 1} {side:>12}: "
                f"{tokens} tokens, {tokens / seconds:7.1f} tok/s{share}",
                flush=True,
            )
    ours, theirs = (statistics.median(results[k]) for k in ("governor", "llama-server"))
    paired = [g / ll for g, ll in zip(results["governor"], results["llama-server"], strict=True)]
    return ours, theirs, paired, in_steps


if __name__ == "__main__":
    main()
