"""The `--fleet` URL: where the fleet's Redis is, read once at start (sans-IO: no connection).

Two forms:

- `redis://[[USER]:PASSWORD@]HOST:PORT/DB`, `rediss://...` (TLS) or `unix://PATH?db=N`: one Redis
  (or Valkey), as redis-py's `from_url` reads it, query options included;
- `redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`: the primary that
  Redis Sentinel names for SERVICE, asked of the listed sentinels at every connection, so that
  the replicas follow a failover. The user and password are the data nodes'; sentinels that
  demand their own give it as `?sentinel_password=...`. (redis-py reads no URL for Sentinel:
  this form extends redis:// with the list of sentinels and the service.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

DIRECT_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class FleetRedis:
    """A parsed `--fleet` URL: `url` as given, and for Sentinel its parts."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()  # empty: one Redis at `url`
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> FleetRedis:
        """Raises ValueError naming what is wrong."""
        scheme = url.partition("://")[0]
        if scheme in DIRECT_SCHEMES:
            parts = urlsplit(url)  # raises ValueError on e.g. an unclosed [IPv6] host
            return cls(url, password=unquote(parts.password) if parts.password else None)
        if scheme != SENTINEL_SCHEME:
            raise ValueError(f"must be a redis://, rediss://, unix:// or {SENTINEL_SCHEME}:// URL")
        rest = url.partition("://")[2]
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        username = password = None
        if at:
            user, colon, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        sentinels = tuple(_host_port(host) for host in hosts.split(",") if host)
        if not sentinels:
            raise ValueError("name at least one sentinel: redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE")
        service, _, db = path.partition("/")
        if not service:
            raise ValueError("name the service Sentinel monitors: redis+sentinel://HOST:PORT/SERVICE[/DB]")
        if db and not db.isdigit():
            raise ValueError(f"the database must be a number, got {db!r}")
        options = parse_qs(query)
        unknown = set(options) - {"sentinel_password"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}: only sentinel_password")
        sentinel_password = options.get("sentinel_password", [None])[-1]
        return cls(url, sentinels, unquote(service), int(db or 0), username, password, sentinel_password)

    def redacted(self) -> str:
        """The URL without its passwords (nor its options, which may carry one), for logs and `stats`."""
        scheme, sep, rest = self.url.partition("://")
        rest = rest.partition("?")[0]
        userinfo, at, host = rest.rpartition("@")
        if not at:
            return f"{scheme}{sep}{rest}"
        user = userinfo.partition(":")[0]
        return f"{scheme}{sep}{user + ':' if user else ':'}***@{host}"


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or not host:
        raise ValueError(f"a sentinel is HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)
