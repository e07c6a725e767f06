"""The GPT-2 engine on CUDA. Skipped, with the reason, where no GPU is present (CI has none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from governor.validation import GenerateRequest
from worker.engine import FinishEvent, LLMEngine
from worker.loading import load, load_hf_model
from worker.scheduler import SchedulerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")

PROMPTS = [("a", "The quick brown fox", 30), ("b", "naïve café " * 4, 12), ("c", "x", 40)]


def run(model_dir: Path, dtype: torch.dtype) -> dict[str, list[int]]:
    loaded = load(str(model_dir), torch.device("cuda"), dtype)
    config = SchedulerConfig(max_batch_size=8, max_prefill_tokens=16, kv_cache_tokens=2048)
    engine = LLMEngine.for_model(loaded, config)
    for rid, prompt, n in PROMPTS:
        engine.add(GenerateRequest(id=rid, prompt=prompt, max_new_tokens=n, temperature=0.0))
    out: dict[str, list[int]] = {}
    while engine.has_work:
        out |= {e.seq.request_id: e.seq.output_ids for e in engine.step() if isinstance(e, FinishEvent)}
    return out


def test_float32_greedy_on_cuda_equals_hf_generate_on_cuda(tiny_gpt2_dir: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, tokenizer = load_hf_model(str(tiny_gpt2_dir))
    model.to("cuda")
    out = run(tiny_gpt2_dir, torch.float32)
    for rid, prompt, n in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)], device="cuda")
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        expected = ref[0, ids.shape[1] :].tolist()
        eos = tokenizer.eos_token_id
        assert out[rid] == (expected[: expected.index(eos)] if eos in expected else expected), rid


def test_bfloat16_runs_every_request_to_its_end(tiny_gpt2_dir: Path) -> None:
    out = run(tiny_gpt2_dir, torch.bfloat16)
    assert set(out) == {"a", "b", "c"}
    assert all(0 < len(out[rid]) <= n for rid, _, n in PROMPTS)
