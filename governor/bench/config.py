"""`governor bench` options: one frozen dataclass; the flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from governor.bench.tenants import TenantGroup, parse_tenant_mix, read_tenant_tokens
from governor.client import ADDRESS_ENV, ADDRESS_HELP, DEFAULT_ADDRESS, default_address
from govwire.address import parse_address
from govwire.auth import SharedSecret
from govwire.options import ConfigError, option


@dataclass(frozen=True)
class BenchConfig:
    address: str = option(default_address(), f"{ADDRESS_HELP}; ${ADDRESS_ENV} when set, else {DEFAULT_ADDRESS}")
    direct: str = option(
        "",
        "connect straight to this worker address instead (same protocol), to measure the governor's cost",
        metavar="ADDRESS",
    )
    auth_token_file: str = option(
        "", "the governor's shared secret (its --auth-token-file), if it wants one", metavar="PATH"
    )
    num_requests: int = option(100, "requests per run")
    prompt: str = option("Hello, governor.", "the prompt (see --prompt-repeats, --unique-prompts)")
    prompt_repeats: int = option(1, "send the prompt repeated this many times")
    unique_prompts: bool = option(False, "prefix each prompt with its request number, so no two are alike")
    prompt_len_dist: str = option(
        "", "fixed:N or uniform:LO-HI: random prompts of that many characters instead of --prompt", metavar="DIST"
    )
    max_new_tokens: int = option(16, "tokens to generate per request")
    stop_on_eos: bool = option(True, "stop at end-of-sequence (--no-stop-on-eos: always max_new_tokens)")
    seed: int = option(0, "seed of prompts and schedules")
    submit_interval_ms: float = option(0.0, "gap between submissions; 0 = all at once")
    submit_schedule: Literal["relative", "absolute", "poisson"] = option(
        "absolute", "relative: sleep after each; absolute: t0 + i*interval; poisson: exponential gaps"
    )
    submit_work_ms: float = option(
        0.0,
        "blocking work on the submit path before each first submission (a stand-in for client-side tokenization)",
    )
    concurrency: int = option(0, "closed loop: N clients, each sends its next request when one ends; 0 = open loop")
    retry: bool = option(False, "retry yielded requests after retry_hint_ms; off: a yield is final")
    max_retries: int = option(5, "with --retry: attempts after the first")
    connections: int = option(1, "TCP connections the requests are spread over")
    warmup_runs: int = option(0, "runs whose results are discarded")
    repeat_runs: int = option(1, "measured runs")
    deadline_ms: float = option(
        0.0, "send deadline_ms (time to first token) with every request and report deadline outcomes; 0 = none"
    )
    slo_ttft_ms: float = option(0.0, "goodput counts requests with TTFT at most this; 0 = no TTFT SLO")
    slo_tpot_ms: float = option(0.0, "goodput counts requests with TPOT at most this; 0 = no TPOT SLO")
    tenant_mix: str = option(
        "",
        "send each request as one of these comma-separated [TENANT][/CLASS]=SHARE entries, drawn by share"
        " (relative weights) with --seed, and report each entry on its own line;"
        " e.g. A=0.7,B=0.3 or A/critical=0.2,A/sheddable=0.3,B=0.5 or /critical=1,/sheddable=1",
        metavar="SPEC",
    )
    tenant_token: tuple[str, ...] = option(
        (),
        "send tenant NAME's requests over connections opened with the secret in PATH, so the governor can"
        " derive the tenant from auth; repeatable; tenants without one use the --auth-token-file connections",
        metavar="NAME=PATH",
    )
    json: str = option("", "write every sample and summary to this file", metavar="PATH")
    plot: str = option(
        "", "write a PNG: TTFT CDF per run, and the governor's inflight and yields over time", metavar="PATH"
    )
    poll_interval_ms: float = option(100.0, "how often the governor's stats are polled for --plot and --json")
    timeout_s: float = option(300.0, "cut a run off after this; unanswered requests count as errors 'timeout'")

    def __post_init__(self) -> None:
        for name in ("address", "direct"):
            try:
                if getattr(self, name):
                    parse_address(getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"--{name}: {exc}") from None
        if self.num_requests <= 0 or self.connections <= 0 or self.repeat_runs <= 0:
            raise ConfigError("--num-requests, --connections and --repeat-runs must be > 0")
        if min(self.concurrency, self.warmup_runs, self.max_retries, self.prompt_repeats - 1) < 0:
            raise ConfigError("--concurrency, --warmup-runs, --max-retries must be >= 0, --prompt-repeats > 0")
        if self.deadline_ms < 0:
            raise ConfigError("--deadline-ms must be >= 0")
        if min(self.submit_interval_ms, self.submit_work_ms) < 0 or self.timeout_s <= 0 or self.poll_interval_ms <= 0:
            raise ConfigError(
                "--submit-interval-ms and --submit-work-ms must be >= 0, --timeout-s and --poll-interval-ms > 0"
            )
        self.token()
        self.tenant_tokens()
        dist = self.prompt_len_dist
        if dist and parse_length_dist(dist) is None:
            raise ConfigError(f"--prompt-len-dist {dist!r}: expected fixed:N or uniform:LO-HI")

    def token(self) -> str | None:
        if not self.auth_token_file:
            return None
        try:
            return SharedSecret.read(self.auth_token_file).token.decode()
        except ValueError as exc:
            raise ConfigError(f"--auth-token-file: {exc}") from None

    def tenant_groups(self) -> tuple[TenantGroup, ...]:
        """The --tenant-mix entries; none without one."""
        if not self.tenant_mix:
            return ()
        try:
            return parse_tenant_mix(self.tenant_mix)
        except ValueError as exc:
            raise ConfigError(f"--tenant-mix {self.tenant_mix!r}: {exc}") from None

    def tenant_tokens(self) -> dict[str, str]:
        """Tenant -> the secret its connections open with (--tenant-token)."""
        groups = self.tenant_groups()
        try:
            return read_tenant_tokens(self.tenant_token, groups)
        except ValueError as exc:
            raise ConfigError(f"--tenant-token: {exc}") from None


def parse_length_dist(text: str) -> tuple[int, int] | None:
    """`fixed:N` -> (N, N), `uniform:LO-HI` -> (LO, HI); None if the text is neither."""
    kind, _, spec = text.partition(":")
    low, _, high = spec.partition("-") if kind == "uniform" else (spec, "", spec)
    if kind not in ("fixed", "uniform") or not (low.isdigit() and high.isdigit()):
        return None
    bounds = int(low), int(high)
    return bounds if 0 < bounds[0] <= bounds[1] else None
