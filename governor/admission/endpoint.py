"""One endpoint of the pool (a link's place in admission): its soft caps and its load, and where an
OpenAI-compatible endpoint is (the other kind is a worker process at an `Address`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from governor.admission.buckets import TokenBucket, make_bucket, updated_bucket
from governor.admission.ttft import TtftModel

if TYPE_CHECKING:
    from governor.admission.appointments.books import AppointmentBook, PrepaidBook


@dataclass(frozen=True, slots=True)
class EndpointLimits:
    """Soft caps of one endpoint; 0 means none."""

    concurrency: int = 0
    qps: float = 0.0
    burst: float = 0.0  # 0 = max(1, qps): one second's worth
    weight: float = 1.0
    tokens: int = 0  # the token cost its admitted, unfinished requests may hold
    step_ms: float = 0.0  # the time between two tokens assumed before its first stream (0: the default prior)
    # How many requests the server runs at once, the rest waiting in its own queue (0: learnt from
    # its streams): the release forecast models the endpoint as that many running plus a FIFO.
    batch: int = 0

    def __post_init__(self) -> None:
        numbers = (self.qps, self.burst, self.weight, self.step_ms)
        if (
            self.concurrency < 0
            or self.tokens < 0
            or self.batch < 0
            or not all(math.isfinite(x) and x >= 0 for x in numbers)
            or self.weight == 0
        ):
            raise ValueError(
                "endpoint limits: concurrency, tokens, batch, qps, burst and step_ms must be finite and >= 0,"
                " weight > 0"
            )
        if 0 < self.burst < 1:
            raise ValueError("endpoint limits: burst must be >= 1 (or 0 for the default)")

    def bucket(self, now: float) -> TokenBucket | None:
        return make_bucket(self.qps, self.burst, now)


@dataclass(frozen=True, slots=True)
class OpenAITarget:
    """An OpenAI-compatible endpoint: `base_url` up to and including `/v1`, the `model` name its
    requests carry, and the file holding the API key it wants, if any (read when the link starts,
    never logged)."""

    base_url: str
    model: str
    api_key_file: str = ""
    # The name front-door clients use for it (`GET /v1/models`, a request's `model`), when the
    # server's own is a path or an internal name: `served_as=NAME`. Requests to it carry `model`.
    served_as: str = ""
    # `ignore_eos` (`stop_on_eos: false`, which guidellm sends for fixed output lengths): passed
    # on as vLLM, SGLang and llama.cpp take it, or, for a server that rejects unknown fields,
    # refused at the door (`ignore_eos=refuse`).
    ignore_eos: Literal["pass", "refuse"] = "pass"
    # Measured by a few short streamed completions each time it comes up (links/endpoint_probe.py):
    # `probe=off` for a server whose every request is billed, or that must see only clients' requests.
    probe: bool = True

    @property
    def served_name(self) -> str:
        return self.served_as or self.model

    def __str__(self) -> str:
        return self.base_url

    @property
    def root(self) -> str:
        """The server's root, where `/health` lives."""
        return self.base_url.removesuffix("/").removesuffix("/v1")


@dataclass(frozen=True, slots=True)
class Probed:
    """What a probe of an OpenAI-compatible endpoint measured before its traffic (links/endpoint_probe.py):
    the release forecast's prior for it until its own streams say more (release_forecast.EngineModel)."""

    step_s: float | None  # the time between two tokens of a probe's stream; None: no stream gave two
    first_token_s: float | None  # from sending a lone probe to its first token (a prompt's prefill, unloaded)
    # How many it ran at once while more probes waited in its queue; 0: none waited (or one probe).
    batch: int = 0


class Endpoint:
    __slots__ = (
        "name",
        "limits",
        "bucket",
        "inflight",
        "tokens",
        "waiting",
        "waiting_tokens",
        "ttft",
        "up",
        "batch",
        "reported_step_s",
        "probed",
        "paused_until",
        "executed",
        "failed",
        "tokens_book",
        "qps_book",
    )

    def __init__(self, name: str, limits: EndpointLimits, now: float, ttft: TtftModel | None = None) -> None:
        self.name = name
        self.limits = limits
        self.bucket = limits.bucket(now)
        self.inflight = 0
        self.tokens = 0  # token cost held by its admitted, unfinished requests
        # Its requests that have no first token yet, and their prompt tokens: the TTFT model's load.
        self.waiting = 0
        self.waiting_tokens = 0
        self.ttft = ttft or TtftModel()
        self.up = False  # set by its link: a down endpoint's capacity does not count
        # How many requests it runs at once, past which they wait inside it (0 = not known): a
        # worker's --max-running, from its statistics (the forecast's EngineModel.batch reads it,
        # after the endpoint's own `batch=`).
        self.batch = 0
        # The time per step its worker reports (EngineStats.step_seconds); None: not reported.
        self.reported_step_s: float | None = None
        # What its last probe measured (an OpenAI-compatible endpoint's, each time it came up); None: not probed.
        self.probed: Probed | None = None
        # An OpenAI-compatible endpoint that answered 429/503 takes nothing new until then (its
        # Retry-After, on the monotonic clock): it said it is full, as a capped endpoint would be.
        self.paused_until = 0.0
        # What became of the requests it ran (Lifecycle.settle, .lose): ended in `done`, or failed
        # there (lost with it, or an error it sent). What the client caused (a 4xx once admitted,
        # a disconnect, a deadline) and yields are not its failures.
        self.executed = 0
        self.failed = 0
        # Its `tokens=N` budget's and its `qps=N` bucket's appointments (pool.py), each from its
        # first refusal there.
        self.tokens_book: AppointmentBook | None = None
        self.qps_book: PrepaidBook | None = None

    def ended(self, executed: bool) -> None:
        """A request it ran ended in `done` (`executed`) or failed through its fault."""
        if executed:
            self.executed += 1
        else:
            self.failed += 1

    def describe(self) -> dict[str, Any]:
        """Its caps and load in `stats` (its link adds what it knows of the other side)."""
        limits = self.limits
        return {
            "name": self.name,  # its metrics label: a --worker's address, or spawned-N
            "up": self.up,
            "inflight": self.inflight,
            "concurrency": limits.concurrency,
            "tokens": limits.tokens,
            "inflight_tokens": self.tokens,
            "qps": limits.qps,
            "weight": limits.weight,
            "executed": self.executed,
            "failed": self.failed,
        }

    def set_limits(self, limits: EndpointLimits, now: float) -> None:
        """Live change: a lower cap stops new admissions until in-flight falls under it."""
        self.limits = limits
        self.bucket = updated_bucket(self.bucket, limits.qps, limits.burst, now)
        if self.qps_book is not None:
            self.qps_book.rebucket()
