"""This replica's lease on the fleet caps (--fleet), read from its member (fleet/member.py) and
lease (fleet/lease.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from governor.fleet.lease import RESOURCES, FleetPolicy
from governor.report.snapshot.parts import HistogramReading

if TYPE_CHECKING:  # a type only: reading the state must not import the Redis client
    from governor.fleet.member import FleetMember


@dataclass(frozen=True, slots=True)
class ShareReading:
    """One fleet cap (fleet/lease.py Share): the limit, this replica's share and use, and the fleet's."""

    resource: str
    limit: float
    share: float
    used: float
    fleet_usage: float
    fleet_want: float
    fleet_granted: float

    def to_dict(self) -> dict[str, float]:
        return {
            "limit": self.limit,
            "share": round(self.share, 3),
            "used": round(self.used, 3),
            "fleet_used": round(self.fleet_usage, 3),
            "fleet_wants": round(self.fleet_want, 3),
            "fleet_granted": round(self.fleet_granted, 3),
        }


@dataclass(frozen=True, slots=True)
class FleetReading:
    """This replica's lease on the fleet caps (--fleet): where it stands, its shares (the caps in
    use only) and the renewals."""

    url: str
    key: str
    member: str
    up: bool
    state: str  # a fleet.lease.FleetState value
    replicas: int
    lapsed: int
    shares: tuple[ShareReading, ...]
    policy: FleetPolicy
    renewal_s: float  # the last renewal's round trip
    renewal_age_ms: float | None
    renewals: Mapping[str, int]  # ok / error
    acks: int
    unacked: int
    cuts: int
    renewal_seconds: HistogramReading

    @classmethod
    def of(cls, member: FleetMember) -> FleetReading:
        lease = member.lease
        shares = tuple(
            ShareReading(name, s.limit, s.share, s.used, s.fleet_usage, s.fleet_want, s.fleet_granted)
            for name, s in zip(RESOURCES, lease.shares, strict=True)
            if s.limit
        )
        return cls(
            member.url,
            member.key,
            member.member_id,
            member.up,
            lease.state.value,
            lease.replicas,
            lease.lapsed,
            shares,
            lease.policy,
            lease.rtt_s,
            member.renewal_age_ms(),
            dict(member.renewals),
            member.acks,
            member.unacked,
            member.cuts,
            HistogramReading.of(member.renewal_seconds),
        )

    def to_dict(self) -> dict[str, Any]:
        policy = self.policy
        return {
            "url": self.url,
            "key": self.key,
            "member": self.member,
            "up": self.up,
            "state": self.state,
            "replicas": self.replicas,
            "lapsed": self.lapsed,
            "resources": {share.resource: share.to_dict() for share in self.shares},
            "renew_ms": policy.renew_s * 1000,
            "lease_ms": policy.lease_s * 1000,
            "unavailable": policy.unavailable,
            "renewal_ms": round(self.renewal_s * 1000, 3),
            "renewal_age_ms": self.renewal_age_ms,
            "hold_ms": policy.hold_s * 1000,
            "max_request_ms": policy.max_request_s * 1000,
            "renewals": dict(self.renewals),
            "acks": self.acks,
            "unacked": self.unacked,
            "cuts": self.cuts,
        }
