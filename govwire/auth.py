"""Shared-secret authentication, the same on both hops (client -> governor, governor -> worker).

The first frame on a connection must be `{"op": "auth", "token": ...}`. The token is compared in
constant time and never logged. On the client hop the token file may hold several secrets, each
naming the tenant its connections act as (`TenantSecrets`); the governor re-reads it on SIGHUP,
so secrets rotate without a restart (connections keep the tenant they opened with).
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson

from govwire.errors import Unauthorized
from govwire.framing import TOO_LARGE, Item
from govwire.request import MAX_ID_CHARS, MAX_TENANT_CHARS, is_tenant_name
from govwire.vocab import DEFAULT_TENANT, Op

MAX_TOKEN_BYTES = 4096
PLACEHOLDER_PREFIX = "replace-me"
"""The example Secrets' values (deploy/k8s/secret.yaml, deploy/k8s-fleet/secret.yaml) start so: a
token or a --fleet password that does is refused, never served."""
AUTH_FRAME_BYTES = 6 * MAX_TOKEN_BYTES + 1024  # the longest line read before authentication (\uXXXX escapes)


@dataclass(frozen=True)
class SharedSecret:
    token: bytes = field(repr=False)  # repr=False: a logged config never shows it

    def matches(self, candidate: object) -> bool:
        if type(candidate) is not str or len(candidate) > MAX_TOKEN_BYTES:
            return False
        return hmac.compare_digest(candidate.encode(), self.token)

    def tenant_of(self, candidate: object) -> str | None:
        """One secret, one population: the default tenant, or None for a wrong token."""
        return DEFAULT_TENANT if self.matches(candidate) else None

    def frame(self) -> dict[str, str]:
        """The frame that opens a connection to a peer expecting this secret."""
        return {"op": Op.AUTH, "token": self.token.decode()}

    @classmethod
    def generate(cls) -> SharedSecret:
        """A per-run secret for the workers the governor spawns."""
        return cls(secrets.token_urlsafe(32).encode())

    @classmethod
    def from_text(cls, text: str, source: str) -> SharedSecret:
        token = text.strip()
        if not token:
            raise ValueError(f"{source}: the token is empty")
        if len(token.split()) > 1:  # (a governor's client file may list `TENANT SECRET` lines)
            raise ValueError(
                f"{source}: holds more than one word or line; this takes one secret alone (a governor's"
                " --auth-token-file of `TENANT SECRET` lines is not a client's: give it a file with its own secret)"
            )
        if len(token.encode()) > MAX_TOKEN_BYTES or not token.isprintable():
            raise ValueError(f"{source}: the token must be printable and at most {MAX_TOKEN_BYTES} bytes")
        if token.startswith(PLACEHOLDER_PREFIX):
            raise ValueError(f"{source}: the token is the shipped placeholder ({token[:40]}…); create a random one")
        return cls(token.encode())

    @classmethod
    def read(cls, path: str) -> SharedSecret:
        return cls.from_text(_read(path, MAX_TOKEN_BYTES + 2), path)


MAX_SECRETS = 10_000
"""Lines a client token file may hold: each is compared on every authentication."""


@dataclass(frozen=True)
class TenantSecrets:
    """The secrets a governor accepts from clients, each with the tenant it authenticates as.

    The file holds one secret per line: `SECRET` alone (the default tenant: a file of one token
    reads as before tenants existed) or `TENANT SECRET`. Blank lines and `#` comments are skipped.
    """

    entries: tuple[tuple[bytes, str], ...] = field(repr=False)  # (secret, tenant); repr=False: never logged

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(tenant for _, tenant in self.entries)

    def tenant_of(self, candidate: object) -> str | None:
        """The tenant whose secret `candidate` is, or None. Every secret is compared (in constant
        time) whatever matched, so the time taken tells nothing about which one did."""
        if type(candidate) is not str or len(candidate) > MAX_TOKEN_BYTES:
            return None
        offered = candidate.encode()
        found: str | None = None
        for token, tenant in self.entries:
            if hmac.compare_digest(offered, token) and found is None:
                found = tenant
        return found

    @classmethod
    def from_text(cls, text: str, source: str) -> TenantSecrets:
        entries: list[tuple[bytes, str]] = []
        seen: set[str] = set()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) > 2:
                raise ValueError(f"{source}:{number}: expected SECRET or TENANT SECRET")
            tenant = DEFAULT_TENANT if len(fields) == 1 else fields[0]
            if not is_tenant_name(tenant):
                raise ValueError(f"{source}:{number}: a tenant is 1 to {MAX_TENANT_CHARS} of A-Z a-z 0-9 _ . -")
            secret = SharedSecret.from_text(fields[-1], f"{source}:{number}")
            if fields[-1] in seen:
                raise ValueError(f"{source}:{number}: the same secret is listed twice")
            seen.add(fields[-1])
            entries.append((secret.token, tenant))
        if not entries:
            raise ValueError(f"{source}: the file is empty: it holds no secret")
        if len(entries) > MAX_SECRETS:
            raise ValueError(f"{source}: more than {MAX_SECRETS} secrets")
        return cls(tuple(entries))

    @classmethod
    def read(cls, path: str) -> TenantSecrets:
        return cls.from_text(_read(path, MAX_SECRETS * (MAX_TOKEN_BYTES + MAX_TENANT_CHARS + 2)), path)


def _read(path: str, limit: int) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(limit)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the token: {exc}") from None


class Secret(Protocol):
    def tenant_of(self, candidate: object) -> str | None:
        """The tenant the candidate token authenticates as; None when it matches no secret."""


class Authenticated(NamedTuple):
    id: str | None  # the auth frame's id, echoed in the reply
    tenant: str  # whom the connection acts as


def auth_candidate(line: Item) -> Any:
    """A line offered as the first frame, parsed for `authenticate`: an oversized or unreadable
    line becomes None, which is as unauthorized as a wrong token."""
    if line is TOO_LARGE:
        return None
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


def authenticate(frame: Any, secret: Secret | None) -> Authenticated:
    """The id of a valid `auth` frame (None when it has none) and the tenant its token names, or
    `Unauthorized`. With no secret configured any `auth` frame passes (as the default tenant), so
    a client set up with a token still talks to a governor without one."""
    if type(frame) is not dict or frame.get("op") != Op.AUTH:
        raise Unauthorized('a connection must open with {"op": "auth", "token": ...}')
    tenant = DEFAULT_TENANT if secret is None else secret.tenant_of(frame.get("token"))
    if tenant is None:
        raise Unauthorized('a connection must open with {"op": "auth", "token": ...} carrying the right token')
    rid = frame.get("id")
    return Authenticated(rid if type(rid) is str and 0 < len(rid) <= MAX_ID_CHARS else None, tenant)
