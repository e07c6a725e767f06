"""Every dtype on the machine at hand: what `--dtype auto` picks, speed, and accuracy against float32.

    python -m benchmarks.engine.dtypes [--dtypes float32,bfloat16,float16,int8] [--device cpu]

`int8` is the worker's `--quantize int8` (float32 activations, int8 linear weights: worker/int8.py),
run as a dtype here: its speed, and its accuracy against float32 by the same check.

1. The CPU's features and what `--dtype auto` resolves to.
2. Speed, in each dtype: one GPT-2 small linear layer ([M, 768] @ [768, 3072], the engine's own
   implementation) at M = 1, 32, 512, the bare matmul chain of a decode step, and the engine's
   decode step at batch 1 and 32 (random weights; the speed does not depend on them), and at
   batch 32 sampled at temperature 1, top_p 0.9 (where the weights do matter: random ones give
   flat rows, whose top-p set is most of the vocabulary, the sampler's worst case).
3. The accuracy check behind `auto`: a model runs teacher-forced over prompts and float32's own
   greedy continuations, in each dtype, and the logits at the continuation positions are compared
   with float32's: top-1 agreement, the largest logit difference, and float32's top-1 margin at
   every position where the argmax flips (a flip at a near-tie is rounding, not damage), then
   free-running greedy streams in each dtype against float32's; and each dtype's perplexity on
   held-out text (benchmarks/harness/perplexity.py), against float32's. The check passes at >= 99% top-1
   agreement on the trained model (benchmarks/harness/model_dir.py --trained: random weights give
   near-flat logits on which any rounding flips the argmax; they are reported too).

Emulated dtypes (bfloat16 and float16 on CPUs without native support) are about a hundred times
slower than float32: expect minutes for their rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.engine_vs_hf import bare_matmuls_ms, decode_step_ms, run_engine, timed_median_ms
from benchmarks.harness import model_dir
from benchmarks.harness.common import machine
from benchmarks.harness.perplexity import held_out_windows, perplexity, perplexity_figure, teacher_forced_logits
from benchmarks.harness.results import Sitting
from benchmarks.harness.workloads import make_workload
from worker.engine import LLMEngine
from worker.loading import DTYPES, cpu_runs_bfloat16_natively, load, resolve_dtype
from worker.model import can_pack_for_cpu
from worker.scheduler import SchedulerConfig

PRECISIONS: dict[str, tuple[torch.dtype, str]] = {
    **{name: (dtype, "none") for name, dtype in DTYPES.items()},
    "int8": (torch.float32, "int8"),
}
"""What each name here loads: the torch dtype and the worker's `--quantize`."""

PASS_AGREEMENT = 0.99
PROMPT_TOKENS = 64  # prompts are cut to this: emulated dtypes run a hundred times slower


def cpu_features() -> dict[str, Any]:
    probes = ("avx2", "avx512", "avx512_bf16", "amx_tile", "amx_fp16")
    features = {p: bool(getattr(torch.cpu, f"_is_{p}_supported", lambda: False)()) for p in probes}
    features["onednn_bf16"] = can_pack_for_cpu(torch.bfloat16)
    features["onednn_fp16"] = can_pack_for_cpu(torch.float16)
    features["native_bf16"] = cpu_runs_bfloat16_natively()
    return features


@torch.inference_mode()
def speed(precision: str, device: torch.device, repeats: int) -> dict[str, Any]:
    dtype, quantize = PRECISIONS[precision]
    loaded = load("random-gpt2", device, dtype, quantize)
    layer = loaded.model.transformer.h[0].mlp.c_fc  # [768] -> [3072], packed where oneDNN can
    out: dict[str, Any] = {"kv_dtype": str(loaded.kv_dtype).removeprefix("torch.")}
    for m in (1, 32, 512):
        x = torch.randn(m, 768, dtype=dtype, device=device)
        ms = timed_median_ms(lambda x=x: layer(x), repeats)
        out[f"linear_m{m}_ms"] = ms
        out[f"linear_m{m}_gflops"] = 2 * m * 768 * 3072 / ms / 1e6
    config = SchedulerConfig(max_batch_size=32, kv_cache_tokens=8192)
    for batch in (1, 32):
        out[f"bare_matmuls_b{batch}_ms"] = bare_matmuls_ms(loaded, batch, steps=repeats)
        # 8-token prompts: an emulated dtype prefills 32 x 64 tokens in minutes
        out[f"decode_step_b{batch}_ms"] = decode_step_ms(loaded, config, batch, steps=repeats, prompt_tokens=8)
    # As OpenAI clients sample by default; random weights give flat rows, the sampler's worst case.
    out["decode_step_b32_sampled_ms"] = decode_step_ms(
        loaded, config, 32, steps=repeats, prompt_tokens=8, temperature=1.0, top_p=0.9
    )
    return out


def accuracy(model: str, precisions: list[str], device: torch.device, n_seq: int, new_tokens: int) -> dict[str, Any]:
    reference = load(model, device, torch.float32)
    limit = min(PROMPT_TOKENS, reference.shape.n_positions - new_tokens)
    prompts = [p for name in ("uniform", "mixed") for p in make_workload(name, 0).prompts][::4][:n_seq]
    prompts = [reference.tokenizer.decode(reference.tokenizer.encode(p)[:limit]) for p in prompts]
    config = SchedulerConfig(max_batch_size=len(prompts), kv_cache_tokens=len(prompts) * reference.shape.n_positions)
    greedy = run_engine(LLMEngine.for_model(reference, config), prompts, [new_tokens] * len(prompts))
    prompt_ids = [reference.tokenizer.encode(p) for p in prompts]
    sequences = [p + g for p, g in zip(prompt_ids, greedy, strict=True)]
    ref_logits = teacher_forced_logits(reference, sequences)
    windows = held_out_windows(reference)
    reference_perplexity = perplexity(reference, windows)
    report: dict[str, Any] = {
        "model": model,
        "sequences": len(sequences),
        "new_tokens": new_tokens,
        "perplexity_tokens": sum(len(w) - 1 for w in windows),
        "float32_perplexity": reference_perplexity,
    }
    for name in precisions:
        if name == "float32":
            continue
        loaded = load(model, device, *PRECISIONS[name])
        logits = teacher_forced_logits(loaded, sequences)
        agree = total = 0
        max_diff, scale, flip_margins = 0.0, 0.0, []
        for ids, ref, got in zip(prompt_ids, ref_logits, logits, strict=True):
            positions = slice(len(ids) - 1, ref.shape[0] - 1)  # the rows that predict the continuation
            r, g = ref[positions], got[positions]
            same = r.argmax(-1) == g.argmax(-1)
            agree += int(same.sum())
            total += same.numel()
            max_diff = max(max_diff, float((r - g).abs().max()))
            scale = max(scale, float(r.std()))
            top2 = r.topk(2, dim=-1).values
            flip_margins += (top2[:, 0] - top2[:, 1])[~same].tolist()
        streams = run_engine(LLMEngine.for_model(loaded, config), prompts, [new_tokens] * len(prompts))
        held_out = perplexity(loaded, windows)
        report[name] = {
            "kv_dtype": str(loaded.kv_dtype).removeprefix("torch."),
            "perplexity": held_out,
            "perplexity_vs_float32": held_out / reference_perplexity,
            "top1_agreement": agree / total,
            "positions": total,
            "max_logit_diff": max_diff,
            "max_logit_diff_over_logit_std": max_diff / scale,
            "largest_fp32_margin_at_a_flip": max(flip_margins, default=0.0),
            "greedy_streams_identical": sum(a == b for a, b in zip(streams, greedy, strict=True)),
            "passes": agree / total >= PASS_AGREEMENT,
        }
    return report


def record(sitting: Sitting, report: dict[str, Any], models: list[str]) -> None:
    """The printed rows as figures: each dtype's decode steps against their bare matmuls and (the
    headline) each 16-bit dtype's batch-32 step against float32's; top-1 agreement with float32 for
    each model and dtype, held to the check's bar, the first model's the headline (the trained one
    by default, which the check is written for); the whole report as details."""
    speed = report.get("speed", {})
    for name, row in speed.items():
        for batch in (1, 32):
            sitting.figure(
                f"decode step, batch {batch}, {name}",
                row[f"decode_step_b{batch}_ms"],
                "ms",
                baseline=("bare matmuls, same shapes", row[f"bare_matmuls_b{batch}_ms"]),
                headline=False,
            )
        sitting.figure(
            f"decode step, batch 32, {name}, sampled (temperature 1, top_p 0.9)",
            row["decode_step_b32_sampled_ms"],
            "ms",
            baseline=("greedy, same batch", row["decode_step_b32_ms"]),
            headline=False,
            note="random weights: flat rows, whose top-p set is most of the vocabulary (the sampler's worst case)",
        )
        sitting.figure(f"linear layer at M = 32, {name}", row["linear_m32_gflops"], "GFLOP/s", headline=False)
        if name != "float32" and "float32" in speed:
            sitting.figure(
                f"{name} decode step vs float32, batch 32",
                row["decode_step_b32_ms"],
                "ms",
                baseline=("float32", speed["float32"]["decode_step_b32_ms"]),
                note=f"KV cache in {row['kv_dtype']} (the worker's default for it)",
            )
    for spec, result in zip(models, report["accuracy"], strict=True):
        for name, row in result.items():
            if not isinstance(row, dict):
                continue
            flips = row["positions"] - round(row["top1_agreement"] * row["positions"])
            sitting.figure(
                f"top-1 agreement with float32, {name}, {spec} model",
                100 * row["top1_agreement"],
                "%",
                bar=f">= {PASS_AGREEMENT:.0%}",
                met=row["passes"],
                headline=spec == models[0],
                note=f"{flips} flips of {row['positions']}; max |dlogit| {row['max_logit_diff']:.3f}, largest"
                f" float32 margin at a flip {row['largest_fp32_margin_at_a_flip']:.3f}; greedy streams identical"
                f" {row['greedy_streams_identical']}/{result['sequences']}",
            )
            perplexity_figure(
                sitting,
                f"held-out perplexity, {name}, {spec} model",
                row["perplexity"],
                result["float32_perplexity"],
                note=f"{result['perplexity_tokens']} held-out tokens (the corpus past what the trained model learnt)",
            )
    sitting.details = report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy-models", default="trained,random-gpt2", help="trained = model_dir.py --trained")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # The default run keeps its own result file; another set of dtypes writes a part beside it.
    default = args.dtypes == parser.get_default("dtypes")
    sitting = Sitting(("worker",), part=None if default else args.dtypes.replace(",", "-"))
    device = torch.device(args.device)
    precisions = args.dtypes.split(",")
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        parser.error(f"--dtypes: no {', '.join(sorted(unknown))} (one of {', '.join(PRECISIONS)})")
    report: dict[str, Any] = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(f"machine: {report['machine']}; torch {torch.__version__}, threads {report['threads']}, device {device}")
    if device.type == "cpu":
        report["cpu"] = cpu_features()
        print("cpu features:", " ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["cpu"].items()))
    report["auto"] = str(resolve_dtype("auto", device)).removeprefix("torch.")
    print(f"--dtype auto -> {report['auto']}")

    if not args.skip_speed:
        print("\n== speed (median of", args.repeats, "runs; ms)")
        report["speed"] = {}
        for name in precisions:
            row = report["speed"][name] = speed(name, device, args.repeats)
            print(
                f"  {name:<9} linear M=1/32/512: {row['linear_m1_ms']:.2f} / {row['linear_m32_ms']:.2f} / "
                f"{row['linear_m512_ms']:.1f} ms ({row['linear_m32_gflops']:.1f} GFLOP/s at M=32)   "
                f"decode step b1 {row['decode_step_b1_ms']:.1f} (bare {row['bare_matmuls_b1_ms']:.1f})   "
                f"b32 {row['decode_step_b32_ms']:.1f} (bare {row['bare_matmuls_b32_ms']:.1f}, "
                f"sampled {row['decode_step_b32_sampled_ms']:.1f}; KV cache {row['kv_dtype']})",
                flush=True,
            )

    print(f"\n== accuracy against float32 (teacher-forced; passes at >= {PASS_AGREEMENT:.0%} top-1 agreement)")
    report["accuracy"] = []
    models = args.accuracy_models.split(",")
    for spec in models:
        model = str(model_dir.ensure_trained()) if spec == "trained" else spec
        result = accuracy(model, precisions, device, args.sequences, args.new_tokens)
        report["accuracy"].append(result)
        for name, row in result.items():
            if isinstance(row, dict):
                print(
                    f"  {spec:<12} {name:<9} top-1 {row['top1_agreement']:.2%} of {row['positions']}   "
                    f"max |dlogit| {row['max_logit_diff']:.3f} ({row['max_logit_diff_over_logit_std']:.2f} std)   "
                    f"largest fp32 margin at a flip {row['largest_fp32_margin_at_a_flip']:.3f}   "
                    f"greedy streams identical {row['greedy_streams_identical']}/{result['sequences']}   "
                    f"{'PASS' if row['passes'] else 'FAIL'}   held-out perplexity {row['perplexity']:.3f}"
                    f" ({row['perplexity_vs_float32']:.4f}x float32's {result['float32_perplexity']:.3f},"
                    f" {result['perplexity_tokens']} tokens; KV cache {row['kv_dtype']})",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    record(sitting, report, models)
    sitting.write()


if __name__ == "__main__":
    main()
