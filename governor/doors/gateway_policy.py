"""How far the front door trusts the headers gateways set, and how their priorities map onto the
governor's classes: configuration (`--tenant-from header`, `--trusted-gateway`, `--objective`,
`--priority-critical-from`, `--priority-sheddable-below`), read by doors/gateway.py."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from govwire.vocab import Priority

_CLASSES = {p.value: p for p in Priority}


@dataclass(frozen=True, slots=True)
class GatewayPolicy:
    """How far the gateway headers are trusted, and how priorities map onto classes."""

    tenant_from_header: bool = False  # --tenant-from header: every client names its tenant
    trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()  # --trusted-gateway
    objectives: dict[str, Priority] = field(default_factory=dict)  # --objective NAME=CLASS
    critical_from: int = 1  # an integer priority at least this is critical
    sheddable_below: int = 0  # one below this is sheddable (GAIE: negative priorities are sheddable)

    def __post_init__(self) -> None:
        if self.sheddable_below > self.critical_from:
            raise ValueError("--priority-sheddable-below must be <= --priority-critical-from")

    def trusts(self, peer: object) -> bool:
        """Whether this connection's headers may name its tenant: every one's with `--tenant-from
        header`, else a `--trusted-gateway` peer's (`peer`: the socket's peername)."""
        if self.tenant_from_header:
            return True
        if not self.trusted or not isinstance(peer, tuple) or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack listener's IPv4 peer
        return any(address in network for network in self.trusted)

    def class_of(self, value: int) -> Priority:
        if value >= self.critical_from:
            return Priority.CRITICAL
        return Priority.SHEDDABLE if value < self.sheddable_below else Priority.STANDARD


def parse_trusted(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A `--trusted-gateway` value: an address or a CIDR block."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address or CIDR block") from None


def parse_objective(text: str) -> tuple[str, Priority]:
    """An `--objective NAME=CLASS` value."""
    name, sep, klass = (part.strip() for part in text.partition("="))
    if not sep or not name or klass not in _CLASSES:
        raise ValueError(f"expected NAME=critical|standard|sheddable, got {text!r}")
    return name, _CLASSES[klass]
