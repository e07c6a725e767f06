"""NVIDIA's aiperf, at its defaults, against the governor's OpenAI-compatible front door.

    python -m benchmarks.aiperf_front_door [--max-inflight 4] [--requests 40]
    make bench-aiperf

aiperf runs from its own venv, `.tools/aiperf` (`make load-tools` installs it there, as `make
test` does for tests/integration/test_aiperf.py). A governor with its front door (`--http-port`) and a
GPT-2 worker (benchmarks/model_dir.py's gpt2-small-bpe: model and tokenizer) is started on free
ports, then aiperf runs twice at its default endpoint type (chat), streaming:
1. a light rate (`--request-rate` --light-rate), which must end with 0 errors;
2. 2.5x the capacity the light run measured (`--max-inflight` / its mean request latency), where
   the cap refuses the excess with 429s, which aiperf counts as errors (it does not retry them):
   its error summary has one row per refusal reason.
`--extra-inputs ignore_eos:true` makes the output lengths exact and `--use-server-token-count`
takes the token counts from the responses' usage. Each run's own console table is printed, and the
artifacts land in benchmarks/out/aiperf/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import free_port, machine, out_dir, start_governor, stop, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
AIPERF_SPEC = "aiperf==0.13.0"
VENV = ROOT / ".tools" / "aiperf"


def aiperf_binary() -> Path:
    binary = VENV / "bin" / "aiperf"
    if not binary.exists():
        raise SystemExit(f"aiperf is not installed in {VENV}: `make load-tools` installs {AIPERF_SPEC} there")
    return binary


def profile(binary: Path, url: str, tokenizer: Path, artifacts: Path, *load: str) -> dict[str, Any]:
    """One aiperf run; prints its console table and returns its JSON export."""
    argv = [str(binary), "profile", "--model", "gpt2", "--url", url, "--streaming", "--tokenizer", str(tokenizer)]
    argv += ["--output-tokens-mean", "16", "--extra-inputs", "ignore_eos:true", "--use-server-token-count"]
    argv += ["--artifact-dir", str(artifacts), "--ui-type", "none", *load]
    # aiperf 0.13 loads a local tokenizer directory only when HF_HUB_OFFLINE is unset (worker/loading.py
    # sets it once imported); a local path reaches no network either way.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    console = artifacts / "profile_export_console.txt"
    if console.exists():
        print(console.read_text())
    if done.returncode:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
        raise RuntimeError(f"aiperf failed with status {done.returncode}")
    return dict(json.loads((artifacts / "profile_export_aiperf.json").read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-inflight", type=int, default=4)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--light-rate", type=float, default=0.5, help="requests/s of the light run")
    p.add_argument("--overload", type=float, default=2.5, help="the second run's rate, in capacities")
    a = p.parse_args()
    binary = aiperf_binary()
    model = out_dir() / "gpt2-small-bpe"
    if not model.exists():
        subprocess.run([sys.executable, "-m", "benchmarks.model_dir"], check=True)
    http = free_port()
    worker = ("--engine", "gpt2", "--model", str(model))
    flags = ("--http-port", str(http), "--integrity", "optional", "--max-inflight", str(a.max_inflight))
    gov, _ = start_governor(*flags, worker_args=worker, timeout=300)
    wait_for_port(http)
    print(f"machine: {machine()}; {AIPERF_SPEC}; governor --max-inflight {a.max_inflight}")
    url = f"http://127.0.0.1:{http}"
    base = out_dir() / "aiperf"
    try:
        light = profile(binary, url, model, base / "light", "--request-rate", str(a.light_rate), "--request-count", "8")
        latency_s = light["request_latency"]["avg"] / 1000
        capacity = a.max_inflight / latency_s
        rate = a.overload * capacity
        print(
            f"light run: {light['error_request_count']['avg'] if 'error_request_count' in light else 0:.0f} errors;"
            f" capacity ~ {a.max_inflight} / {latency_s:.2f} s = {capacity:.2f} req/s; overload at {rate:.2f} req/s"
        )
        over = profile(
            binary, url, model, base / "overload", "--request-rate", f"{rate:.3f}", "--request-count", str(a.requests)
        )
    finally:
        stop(gov)
    rows = over.get("error_summary", [])
    print("overload error summary, one row per distinct error:")
    for row in rows:
        details = row["error_details"]
        print(f"  {details['code']} {details['type']}: {details['message']}  x{row['count']}")


if __name__ == "__main__":
    main()
