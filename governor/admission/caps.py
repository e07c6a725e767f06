"""The six caps every scope declares the same way: the governor's own (`--max-inflight` ...), a
tenant's (tenant.TenantLimits) and the fleet's (fleet.FleetPolicy, `--fleet-max-inflight` ...).
One value, so that a seventh cap is added once; 0 means that cap is not set."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Caps:
    max_inflight: int = 0  # requests in flight at once
    max_qps: float = 0.0  # admissions per second (a token bucket)
    qps_burst: float = 0.0  # its bucket's size; 0 = one second's worth
    max_inflight_tokens: int = 0  # token cost in flight at once (admission/cost.py)
    max_tokens_per_s: float = 0.0  # token cost admitted per second (a token bucket)
    tokens_burst: float = 0.0  # its bucket's size; 0 = one second's worth

    def rates_are_finite(self) -> bool:
        """The two rates and their bursts: finite and >= 0 (what every scope checks)."""
        rates = (self.max_qps, self.qps_burst, self.max_tokens_per_s, self.tokens_burst)
        return all(math.isfinite(x) and x >= 0 for x in rates)


CAP_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Caps))
