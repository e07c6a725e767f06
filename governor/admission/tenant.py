"""Who a request is for: the tenant table, each tenant's limits, and what each tenant holds.

A tenant is named by the secret its connection authenticated with, or by the frame's `tenant`
field under `--tenant-from frame`; a name the table does not know is the default tenant's. The
table holds the tenants the config names (`[[tenant]]` tables or `--tenant` flags), those the
client token file names (weight 1, no caps of their own), and `default`: a bounded set, so every
per-tenant metric has bounded cardinality. A reload (SIGHUP) changes the table in place: a tenant
that stays keeps its counters and what it holds, one that goes keeps being released by the
requests it still runs, and its connections act as the default tenant from then on.

Each tenant's own caps are checked by tenant_caps.py, the fair shares between tenants by
fair_share.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from governor.admission.buckets import make_bucket, updated_bucket
from governor.admission.caps import CAP_KEYS, Caps
from governor.admission.hints import DrainHint, RetryHintEstimator
from governor.admission.tally import Tally
from govwire.request import is_tenant_name
from govwire.vocab import DEFAULT_TENANT

if TYPE_CHECKING:
    from governor.admission.appointments.books import AppointmentBook, PrepaidBook


@dataclass(frozen=True, slots=True)
class TenantLimits(Caps):
    """One tenant's weight and caps (caps.Caps); a cap of 0 means none (the global caps still apply)."""

    weight: float = 1.0  # its share of contended capacity, relative to the other tenants' weights
    # While it holds fewer, it may be admitted past --max-inflight (limits.InflightLimiter).
    guaranteed_inflight: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.weight < math.inf):
            raise ValueError("weight must be finite and > 0")
        if self.max_inflight < 0 or self.max_inflight_tokens < 0 or self.guaranteed_inflight < 0:
            raise ValueError("max_inflight, max_inflight_tokens and guaranteed_inflight must be >= 0")
        if self.max_inflight and self.guaranteed_inflight > self.max_inflight:
            raise ValueError("guaranteed_inflight cannot exceed the tenant's own max_inflight")
        if not self.rates_are_finite():
            raise ValueError("max_qps, qps_burst, max_tokens_per_s and tokens_burst must be finite and >= 0")
        if 0 < self.qps_burst < 1 or 0 < self.tokens_burst < 1:
            raise ValueError("qps_burst and tokens_burst must be >= 1 (or 0 for the default)")


TENANT_KEYS: tuple[str, ...] = ("weight", *CAP_KEYS, "guaranteed_inflight")
"""A tenant's keys, in the order a table lists them (its weight first)."""


def parse_tenant(text: str) -> tuple[str, TenantLimits]:
    """`NAME[,weight=W][,max_inflight=N][,max_qps=R]...` (the keys of `TenantLimits`) -> name and limits."""
    name, *options = text.split(",")
    name = name.strip()
    if not is_tenant_name(name):
        raise ValueError(f"tenant name {name!r}: 1 to 64 characters of A-Z a-z 0-9 _ . -")
    kinds = {f.name: f.type for f in fields(TenantLimits)}
    values: dict[str, int | float] = {}
    for item in options:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in kinds:
            raise ValueError(f"expected key=value with a key among {', '.join(TENANT_KEYS)}, got {item!r}")
        try:
            values[key] = int(value) if kinds[key] == "int" else float(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a number") from None
    try:
        return name, TenantLimits(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"tenant {name}: {exc}") from None


class Tenant:
    """One tenant: its limits, what its admitted requests hold, its fair-share state and its tally."""

    __slots__ = (
        "name",
        "limits",
        "inflight",
        "tokens",
        "qps_bucket",
        "token_bucket",
        "service",
        "contending_until",
        "tally",
        "request_drain",
        "token_drain",
        "inflight_book",
        "tokens_book",
        "qps_book",
        "token_rate_book",
        "share_book",
    )

    def __init__(self, name: str, limits: TenantLimits, hints: RetryHintEstimator, now: float) -> None:
        self.name = name
        self.limits = limits
        self.inflight = 0  # its admitted, unfinished requests
        self.tokens = 0  # the token cost they hold
        self.qps_bucket = make_bucket(limits.max_qps, limits.qps_burst, now)
        self.token_bucket = make_bucket(limits.max_tokens_per_s, limits.tokens_burst, now)
        # Fair share (fair_share.py): its virtual token counter, the token cost it was served
        # divided by its weight, and until when it counts as contending for capacity.
        self.service = 0.0
        self.contending_until = -math.inf
        self.tally = Tally()  # its admitted, executed and yielded frames (accounting.py)
        self.request_drain = DrainHint(hints)  # its fair share's hints (fair_share.py)
        self.token_drain = DrainHint(hints)
        # Its own caps' appointments (tenant_caps.py), each from its first refusal there.
        self.inflight_book: AppointmentBook | None = None
        self.tokens_book: AppointmentBook | None = None
        self.qps_book: PrepaidBook | None = None
        self.token_rate_book: PrepaidBook | None = None
        self.share_book: AppointmentBook | None = None  # its turns past its fair share (fair_share.py)

    def set_limits(self, limits: TenantLimits, now: float) -> None:
        """Live change: a lower cap stops new admissions until what it holds falls under it."""
        self.limits = limits
        self.qps_bucket = updated_bucket(self.qps_bucket, limits.max_qps, limits.qps_burst, now)
        self.token_bucket = updated_bucket(self.token_bucket, limits.max_tokens_per_s, limits.tokens_burst, now)
        for book in (self.qps_book, self.token_rate_book):
            if book is not None:
                book.rebucket()

    def __repr__(self) -> str:
        return f"Tenant({self.name!r}, inflight={self.inflight}, tokens={self.tokens})"


class Tenants:
    """The tenant table. `resolve` runs for every generate frame: one dict lookup."""

    __slots__ = ("_hints", "_by_name", "default", "configured")

    def __init__(self, hints: RetryHintEstimator, now: float) -> None:
        self._hints = hints
        self.default = Tenant(DEFAULT_TENANT, TenantLimits(), hints, now)
        self._by_name: dict[str, Tenant] = {DEFAULT_TENANT: self.default}
        self.configured: frozenset[str] = frozenset()  # the tenants with limits of their own

    def resolve(self, name: object) -> Tenant:
        """The tenant called `name`; the default tenant for a name nobody configured (or a non-name)."""
        return self._by_name.get(name, self.default) if type(name) is str else self.default

    def configure(self, limits: dict[str, TenantLimits], implicit: Iterable[str], now: float) -> None:
        """Make the table `limits` (tenants with caps) plus `implicit` (names the token file gives,
        weight 1 and no caps unless `limits` has them) plus the default tenant."""
        wanted = {name: TenantLimits() for name in implicit} | dict(limits)
        wanted.setdefault(DEFAULT_TENANT, TenantLimits())
        table: dict[str, Tenant] = {}
        for name, tenant_limits in wanted.items():
            tenant = self._by_name.get(name)
            if tenant is None:
                tenant = Tenant(name, tenant_limits, self._hints, now)
            elif tenant.limits != tenant_limits:
                tenant.set_limits(tenant_limits, now)
            table[name] = tenant
        self._by_name = table
        self.default = table[DEFAULT_TENANT]
        self.configured = frozenset(limits)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def any_caps(self) -> bool:
        """Whether any tenant has a cap of its own (TenantCaps has something to check)."""
        return any(
            t.limits != TenantLimits(weight=t.limits.weight, guaranteed_inflight=t.limits.guaranteed_inflight)
            for t in self
        )

    @property
    def guaranteed_inflight(self) -> int:
        """The sum of the tenants' guarantees: how far past --max-inflight they may take it."""
        return sum(t.limits.guaranteed_inflight for t in self)
