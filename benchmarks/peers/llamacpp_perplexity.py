"""int8 against llama.cpp's Q8_0 on quality: how far each moves perplexity from its own float32.

    python -m benchmarks.peers.llamacpp_perplexity [--chunks 16]

The trained model (benchmarks/harness/model_dir.py --trained) on its held-out text (the corpus
past what it learnt from: `model_dir.held_out`):
- ours: the engine's teacher-forced perplexity in float32 and with `--quantize int8`
  (benchmarks/harness/perplexity.py, over `--chunks` windows of the model's 128-token context,
  every position scored);
- llama.cpp: `llama-perplexity` (built beside llama-server, benchmarks/peers/llamacpp.py) on the
  same text converted by its own converter to f32 and Q8_0 GGUF, `--chunks` windows of 128
  tokens (it scores the second half of each window).

The two count different positions, so each side is compared with its own float32: the ratio
quantized / float32, and how close to 1 each is (issue 61's target: ours at least as close as
Q8_0, and within 1%). Where CMake or a C++ compiler is missing it says so and exits 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import torch

from benchmarks.harness import model_dir
from benchmarks.harness.common import machine, markdown_table, out_dir
from benchmarks.harness.perplexity import held_out_windows, perplexity, perplexity_figure
from benchmarks.harness.results import Sitting
from benchmarks.peers.llamacpp import GGUF_TYPES, gguf, llama_server, llama_source, missing_tools
from worker.loading import load

CONTEXT = model_dir.TRAINED_CONTEXT
_FINAL = re.compile(rb"Final estimate: PPL = ([0-9.]+)")


def llama_perplexity(work: Path, source: Path) -> Path:
    """The llama-perplexity binary, built in llama-server's tree (its objects are shared)."""
    binary = work / "build" / "bin" / "llama-perplexity"
    if not binary.exists():
        llama_server(work, source)  # (configures the build)
        subprocess.run(["cmake", "--build", str(work / "build"), "--target", "llama-perplexity"], check=True)
    return binary


def theirs(binary: Path, model: Path, text: Path, chunks: int, threads: int) -> float:
    argv = [str(binary), "-m", str(model), "-f", str(text), "-c", str(CONTEXT), "--chunks", str(chunks)]
    done = subprocess.run([*argv, "-t", str(threads)], capture_output=True, check=True)
    found = _FINAL.search(done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate for {model.name}")
    return float(found.group(1))


def ours(trained: Path, chunks: int) -> dict[str, float]:
    """The engine's perplexity in float32 and with int8 weights, on the same windows (the
    held-out text tokenized once: both share the model's tokenizer)."""
    cpu = torch.device("cpu")
    reference = load(str(trained), cpu, torch.float32)
    windows = held_out_windows(reference, chunks)
    quantized = load(str(trained), cpu, torch.float32, "int8")
    return {"float32": perplexity(reference, windows), "int8": perplexity(quantized, windows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16, help="windows of the model's context, each side")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sitting = Sitting(("worker",))
    missing = missing_tools()
    if missing:
        print(f"skipped: {', '.join(missing)} not found (install CMake and a C++ compiler to build llama.cpp)")
        return
    torch.set_num_threads(args.threads)
    work = out_dir() / "llamacpp"
    work.mkdir(parents=True, exist_ok=True)
    source = llama_source(work)
    binary = llama_perplexity(work, source)
    trained = model_dir.ensure_trained()
    text = work / "held-out.txt"
    text.write_text("".join(model_dir.held_out()), encoding="utf-8")
    print(f"machine: {machine()}; model {trained.name}; {args.chunks} windows of {CONTEXT} tokens each side")
    llama = {
        d: theirs(binary, gguf(work, source, trained, d), text, args.chunks, args.threads) for d in ("float32", "int8")
    }
    mine = ours(trained, args.chunks)
    rows = []
    for side, ppl, quantized in (("governor's engine", mine, "int8"), ("llama.cpp", llama, GGUF_TYPES["int8"])):
        ratio = ppl["int8"] / ppl["float32"]
        rows.append([side, f"{ppl['float32']:.4f}", f"{quantized}: {ppl['int8']:.4f}", f"{ratio:.5f}x"])
        perplexity_figure(sitting, f"held-out perplexity, {quantized} vs float32, {side}", ppl["int8"], ppl["float32"])
    ours_off, theirs_off = (abs(ppl["int8"] / ppl["float32"] - 1.0) * 100 for ppl in (mine, llama))
    sitting.figure(
        "int8 as close to float32 as llama.cpp's Q8_0 (held-out perplexity)",
        ours_off,
        "%",
        baseline=("Q8_0", theirs_off),
        bar="<= Q8_0's",
        met=ours_off <= theirs_off,
    )
    print(markdown_table(["side", "float32", "quantized", "ratio"], rows))
    sitting.details = {"ours": mine, "llama_cpp": llama, "chunks": args.chunks, "context": CONTEXT}
    sitting.write()


if __name__ == "__main__":
    main()
