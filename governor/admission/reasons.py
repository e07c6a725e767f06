"""What each refusal reason means to admission, in one table: whether its limit is capacity the
classes share (a higher class refused it closes the lower classes' gates, priority.py) and whether
its limit keeps appointments for the clients it refuses (appointments/). The wire spells the
reasons (govwire.vocab.YieldReason); a reason not here does neither."""

from __future__ import annotations

from govwire.vocab import YieldReason as R

# reason: (shared capacity, books appointments), in the order the appointments are reported
TRAITS: dict[R, tuple[bool, bool]] = {
    R.INFLIGHT: (True, True),
    R.QPS: (True, True),
    R.TOKENS: (True, True),
    R.TOKEN_RATE: (True, True),
    R.ENDPOINT_INFLIGHT: (True, True),
    R.ENDPOINT_QPS: (True, True),
    R.ENDPOINT_TOKENS: (True, True),
    # a tenant's own caps: the lower classes' restraint frees none of them
    R.TENANT_INFLIGHT: (False, True),
    R.TENANT_QPS: (False, True),
    R.TENANT_TOKENS: (False, True),
    R.TENANT_TOKEN_RATE: (False, True),
    R.TENANT_SHARE: (False, True),
    # this replica's share of the fleet's in-flight cap (fleet/lease.py, build.fleet_book)
    R.FLEET_INFLIGHT: (True, True),
    # shared, but promised by others: the endpoint's own Retry-After, the fleet's other shares
    R.ENDPOINT_BUSY: (True, False),
    R.FLEET_QPS: (True, False),
    R.FLEET_TOKENS: (True, False),
    R.FLEET_TOKEN_RATE: (True, False),
}

GATING = frozenset(reason.value for reason, (shared, _) in TRAITS.items() if shared)
"""The refusals of shared capacity: one of a higher-class frame closes the lower classes' gates
(a tenant's own caps, a deadline or draining do not)."""

BOOKING = tuple(reason.value for reason, (_, books) in TRAITS.items() if books)
"""The limits that book appointments (none with --retry-hint fixed): reported from the start."""
