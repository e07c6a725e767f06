"""NVIDIA's aiperf, a load generator LLM teams run, at its defaults against the front door.

aiperf comes from its own venv (`make load-tools`, which `make test` runs); where it could not be
installed this skips, saying so. Its default endpoint type is chat, so this is also the chat path
through the project's own worker, with aiperf's own accounting of the answers.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness.fixtures.redis_server import free_port
from tests.integration.test_gpt2_worker import Start, gpt2_governor

AIPERF = Path(__file__).resolve().parents[2] / ".tools" / "aiperf" / "bin" / "aiperf"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not AIPERF.exists(), reason=f"aiperf is not installed at {AIPERF} (make load-tools)"),
]


def aiperf(port: int, tokenizer: Path, artifacts: Path, *load: str) -> dict[str, Any]:
    """One run at aiperf's defaults (chat, not streamed), but for its sizes: the tiny model's
    context is 128 tokens, so 16-token prompts and 8 tokens out."""
    argv = [str(AIPERF), "profile", "--model", "gpt2", "--url", f"http://127.0.0.1:{port}"]
    argv += ["--tokenizer", str(tokenizer), "--prompt-input-tokens-mean", "16", "--prompt-input-tokens-stddev", "0"]
    argv += ["--output-tokens-mean", "8", "--artifact-dir", str(artifacts), "--ui-type", "none", *load]
    # aiperf 0.13 loads a local tokenizer directory only when HF_HUB_OFFLINE is unset (which
    # worker/loading.py sets in this process); it reaches no network for a local path either way.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads((artifacts / "profile_export_aiperf.json").read_text()))


@pytest.mark.timeout(600)
def test_aiperf_at_its_defaults_gets_through_and_counts_each_refusal_reason_once(
    start_governor: Start, tiny_gpt2_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    gov = gpt2_governor(start_governor, tiny_gpt2_dir, "--http-port", str(port), "--integrity", "optional",
                        "--max-inflight", "2")  # fmt: skip
    light = aiperf(port, tiny_gpt2_dir, tmp_path / "light", "--concurrency", "1", "--request-count", "4")
    assert light["request_count"]["avg"] == 4 and not light.get("error_summary"), light.get("error_summary")
    # Six at a time against a cap of 2: the rest are 429s, which aiperf counts as errors (it does not
    # retry): one row per kind of answer, since every refusal of a reason has the same body: the
    # retryable one ("yielded: inflight") and, for those past the promise horizon, the final one
    # ("overloaded", reason inflight).
    over = aiperf(port, tiny_gpt2_dir, tmp_path / "over", "--concurrency", "6", "--request-count", "18")
    rows = over["error_summary"]
    messages = sorted(row["error_details"]["message"] for row in rows)
    assert 1 <= len(rows) <= 2 and all(row["error_details"]["code"] == 429 for row in rows), rows
    assert all('"message":"yielded: inflight"' in m or '"code":"overloaded","reason":"inflight"' in m for m in messages)
    assert len(set(messages)) == len(rows)  # one row each: no number in a body
    assert over["request_count"]["avg"] >= 1
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="settled")
    s = gov.stats()
    refused = sum(row["count"] for row in rows)
    assert s["received_by_protocol"]["http"] == s["received_total"] and s["yielded_by_reason"]["inflight"] == refused
