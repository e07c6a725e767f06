"""The load generators LLM teams run, at their defaults, against the governor's front door.

    python -m benchmarks.peers.load_generators aiperf|guidellm [--max-inflight 4] [--requests 40]
    make bench-aiperf / make bench-guidellm

Each tool runs from its own venv under `.tools/` (`make load-tools` installs aiperf 0.13.0 there,
as `make test` does for tests/integration/test_aiperf.py; `make bench-guidellm` installs guidellm
0.8.1). A governor with its front door (`--http-port`) and a GPT-2 worker (benchmarks/harness/model_dir.py's
gpt2-small-bpe, model and tokenizer) is started on free ports, then the tool runs twice at its
default endpoint type (chat), streaming:
1. a light rate (--light-rate), which must end with 0 errors;
2. --overload times the capacity the light run measured (`--max-inflight` / its mean request
   latency: an upper bound, since batching slows requests down), where the cap refuses the
   excess with 429s, which both tools count as errors (neither retries them).
Output lengths are exact (aiperf: `--extra-inputs ignore_eos:true`; guidellm sends `ignore_eos`
itself) and aiperf takes the token counts from the responses (`--use-server-token-count`). The
tool's own tables are printed, then the distinct errors of the overload run with their counts;
artifacts land in benchmarks/out/<tool>/. guidellm names its tokenizer by the request's `model`,
so the worker's model is served under its directory's path (`--served-model`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
from pathlib import Path

from benchmarks.harness.common import ROOT, machine, out_dir, start_front_door, stop
from benchmarks.harness.model_dir import ensure as ensure_model_dir
from benchmarks.harness.results import Sitting

TOOLS = ROOT / ".tools"


def tool_env() -> dict[str, str]:
    # Both load a local tokenizer directory only when HF_HUB_OFFLINE is unset (worker/loading.py
    # sets it once imported); a local path reaches no network either way.
    return {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}


class Tool:
    """A load generator: where it lives, and one run of it against `url`."""

    spec: str
    binary: Path

    def __init__(self, url: str, model: Path, artifacts: Path) -> None:
        self.url, self.model, self.artifacts = url, model, artifacts

    def run(self, name: str, rate: float, requests: int) -> tuple[float, dict[str, int]]:
        """(mean request latency in s, distinct errors with their counts)."""
        raise NotImplementedError


class Aiperf(Tool):
    spec = "aiperf==0.13.0"
    binary = TOOLS / "aiperf" / "bin" / "aiperf"

    def run(self, name: str, rate: float, requests: int) -> tuple[float, dict[str, int]]:
        out = self.artifacts / name
        argv = [str(self.binary), "profile", "--model", str(self.model), "--url", self.url, "--streaming"]
        argv += ["--tokenizer", str(self.model), "--output-tokens-mean", "16", "--extra-inputs", "ignore_eos:true"]
        argv += ["--use-server-token-count", "--artifact-dir", str(out), "--ui-type", "none"]
        argv += ["--request-rate", f"{rate:.3f}", "--request-count", str(requests)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=tool_env())
        console = out / "profile_export_console.txt"
        if console.exists():
            print(console.read_text())
        if done.returncode:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            raise RuntimeError(f"aiperf failed with status {done.returncode}")
        report = json.loads((out / "profile_export_aiperf.json").read_text())
        errors = {
            f"{row['error_details']['code']} {row['error_details']['message']}": row["count"]
            for row in report.get("error_summary", [])
        }
        return report["request_latency"]["avg"] / 1000, errors


class Guidellm(Tool):
    spec = "guidellm==0.8.1"
    binary = TOOLS / "guidellm" / "bin" / "guidellm"

    def run(self, name: str, rate: float, requests: int) -> tuple[float, dict[str, int]]:
        report = self.artifacts / f"{name}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(self.binary), "run", "--backend", f"kind=openai_http,target={self.url},model={self.model}"]
        argv += ["--profile", f"kind=constant,rate={rate:.3f}", "--constraint", f"kind=max_requests,count={requests}"]
        argv += ["--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16"]
        argv += ["--output", f"kind=json,path={report}", "--output", "kind=console", "--disable-console-interactive"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=tool_env())
        print(done.stdout[-12000:])
        if done.returncode:
            print(done.stderr[-4000:])
            raise RuntimeError(f"guidellm failed with status {done.returncode}")
        (benchmark,) = json.loads(report.read_text())["benchmarks"]
        completed = benchmark["requests"]["successful"]
        latency = sum(float(r["request_latency"]) for r in completed) / max(1, len(completed))
        errors = collections.Counter(
            str((r.get("info") or {}).get("error", "?")) for r in benchmark["requests"]["errored"]
        )
        return latency, dict(errors)


TOOL_CLASSES: dict[str, type[Tool]] = {"aiperf": Aiperf, "guidellm": Guidellm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tool", choices=sorted(TOOL_CLASSES))
    p.add_argument("--max-inflight", type=int, default=4)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--light-rate", type=float, default=0.5, help="requests/s of the light run")
    p.add_argument("--overload", type=float, default=2.5, help="the second run's rate, in capacities")
    a = p.parse_args()
    sitting = Sitting(("govwire", "governor", "worker"), part=a.tool)
    kind = TOOL_CLASSES[a.tool]
    if not kind.binary.exists():
        raise SystemExit(f"{a.tool} is not installed at {kind.binary}: `make bench-{a.tool}` installs {kind.spec}")
    model = ensure_model_dir()
    worker = ("--engine", "gpt2", "--model", str(model))
    flags = ("--max-inflight", str(a.max_inflight), "--served-model", str(model))
    gov, _, http = start_front_door(*flags, worker_args=worker, timeout=300)
    print(f"machine: {machine()}; {kind.spec}; governor --max-inflight {a.max_inflight}")
    tool = kind(f"http://127.0.0.1:{http}", model, out_dir() / a.tool)
    try:
        latency_s, light_errors = tool.run("light", a.light_rate, 8)
        capacity = a.max_inflight / latency_s
        rate = a.overload * capacity
        print(f"light run: {sum(light_errors.values())} errors; capacity ~ {a.max_inflight} / {latency_s:.2f} s")
        print(f"  = {capacity:.2f} req/s; overload at {rate:.2f} req/s")
        _, errors = tool.run("overload", rate, a.requests)
    finally:
        stop(gov)
    print("overload, its distinct errors:")
    for error, count in errors.items():
        print(f"  x{count}: {error[:200]}")
    record(sitting, latency_s, light_errors, capacity, rate, errors)
    sitting.write()


def record(
    sitting: Sitting,
    latency_s: float,
    light_errors: dict[str, int],
    capacity: float,
    rate: float,
    errors: dict[str, int],
) -> None:
    """What the tool reported: the light run's errors (bar: none) and how many distinct errors the
    overload's 429s made in its report (bar: one kind, so that a team reading it sees one cause)."""
    light = sum(light_errors.values())
    sitting.figure("errors at a light rate", light, "requests", bar="0 errors", met=light == 0)
    kinds = len(errors)
    sitting.figure("distinct errors in the overload's report", kinds, "kinds", bar="1 kind", met=kinds == 1)
    sitting.figure("errors in the overload", sum(errors.values()), "requests", headline=False)
    sitting.figure("light run's mean request latency", latency_s * 1000, "ms", headline=False)
    sitting.figure("capacity estimate (--max-inflight / latency)", capacity, "req/s", headline=False)
    sitting.figure("overload rate", rate, "req/s", headline=False)
    sitting.details = {"light_errors": light_errors, "overload_errors": errors}


if __name__ == "__main__":
    main()
