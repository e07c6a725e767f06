"""`--tenant-mix` and `--tenant-token`: whom each request of a run speaks for, and over which connections.

A mix is a comma list of `[TENANT][/CLASS]=SHARE` entries, shares being relative weights. Each
request draws its entry once, from the run's seeded generator, for the whole workload: warm-up and
measured runs send the same mix, and a seed reproduces who sent what. Pure, so the parsing and the
draw are unit-tested without sockets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from govwire.auth import SharedSecret
from govwire.request import MAX_TENANT_CHARS, is_tenant_name
from govwire.vocab import Priority

_CLASSES = {p.value: p for p in Priority}


@dataclass(frozen=True, slots=True)
class TenantGroup:
    """One entry of the mix: what its requests' frames carry, and its share of the requests."""

    tenant: str  # "" = the frame names none: it speaks for its connection's tenant
    priority: Priority | None  # None = the frame names none: the standard class
    share: float  # of all requests, normalised over the mix

    @property
    def label(self) -> str:
        """The entry as the spec wrote it (`A`, `A/critical`, `/sheddable`): its name in the report."""
        return self.tenant if self.priority is None else f"{self.tenant}/{self.priority.value}"


UNTAGGED = TenantGroup("", None, 1.0)
"""The group of every request of a run without --tenant-mix: its frames name neither field."""


def parse_tenant_mix(text: str) -> tuple[TenantGroup, ...]:
    """The groups of a `--tenant-mix` spec in the order written; ValueError naming the entry at fault."""
    weights: dict[tuple[str, Priority | None], float] = {}
    for entry in text.split(","):
        name, equals, share_text = entry.rpartition("=")
        tenant, slash, cls = name.strip().partition("/")
        priority = _CLASSES.get(cls)
        if not equals or not (tenant or slash):
            raise ValueError(f"{entry!r}: expected [TENANT][/CLASS]=SHARE, naming a tenant, a class or both")
        if tenant and not is_tenant_name(tenant):
            raise ValueError(f"{entry!r}: a tenant is 1 to {MAX_TENANT_CHARS} characters of A-Z a-z 0-9 _ . -")
        if slash and priority is None:
            raise ValueError(f"{entry!r}: the class must be one of {', '.join(_CLASSES)}")
        try:
            share = float(share_text)
        except ValueError:
            share = math.nan
        if not (math.isfinite(share) and share > 0):
            raise ValueError(f"{entry!r}: the share must be a number > 0")
        key = (tenant, priority)
        if key in weights:
            raise ValueError(f"{entry!r}: that group is named twice")
        weights[key] = share
    total = sum(weights.values())
    if not math.isfinite(total):
        raise ValueError("the shares are too large to add up")
    return tuple(TenantGroup(tenant, priority, w / total) for (tenant, priority), w in weights.items())


def assign_groups(groups: Sequence[TenantGroup], count: int, rng: random.Random) -> list[TenantGroup]:
    """Each of `count` requests' group, drawn by share. Without a mix nothing is drawn, so every
    other random choice of the run (prompts, schedule, jitter) is what it was before the flag."""
    if not groups:
        return [UNTAGGED] * count
    return rng.choices(groups, weights=[g.share for g in groups], k=count)


def read_tenant_tokens(entries: Sequence[str], groups: Sequence[TenantGroup]) -> dict[str, str]:
    """`--tenant-token NAME=PATH` entries as tenant -> the secret in PATH. A NAME no group of the mix
    names would open connections nothing is sent over, and is refused like a malformed entry."""
    tenants = {g.tenant for g in groups}
    tokens: dict[str, str] = {}
    for entry in entries:
        name, equals, path = entry.partition("=")
        if not equals or not path:
            raise ValueError(f"{entry!r}: expected NAME=PATH")
        if name not in tenants:
            raise ValueError(f"{entry!r}: --tenant-mix names no tenant {name!r}")
        if name in tokens:
            raise ValueError(f"{entry!r}: tenant {name!r} has a token already")
        tokens[name] = SharedSecret.read(path).token.decode()
    return tokens
