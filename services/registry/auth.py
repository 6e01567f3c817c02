"""Bearer tokens, stored only as SHA-256 hashes, mapped to a role and (for publishers) a tenant.

Roles: admin (everything), publisher (publish, split, roll back, disable, purge within its
own org/team/project; a `*` segment matches any), reader (reads), worker (blob fetches
only). An unknown or missing token is 401; a known token without the right is 403.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from services.contracts.events import TenantRef

Role = Literal["admin", "publisher", "reader", "worker"]
ROLES: tuple[Role, ...] = ("admin", "publisher", "reader", "worker")


class AuthConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    """Who is calling. `actor` goes into each event's envelope and scopes idempotency keys."""

    token_id: str
    role: Role
    tenant_pattern: tuple[str, str, str] | None = None

    @property
    def actor(self) -> str:
        return f"{self.role}:{self.token_id}"

    def may_write_for(self, tenant: TenantRef) -> bool:
        if self.role == "admin":
            return True
        if self.role != "publisher" or self.tenant_pattern is None:
            return False
        return all(p in ("*", v) for p, v in
                   zip(self.tenant_pattern, (tenant.org, tenant.team, tenant.project),
                       strict=True))

    def may_read_for(self, tenant: TenantRef | None) -> bool:
        if self.role in ("admin", "reader"):
            return True
        return tenant is not None and self.may_write_for(tenant)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenBook:
    """The configured tokens, by hash. Presented tokens are hashed and looked up."""

    def __init__(self, principals: dict[str, Principal]) -> None:
        self._by_hash = principals

    @classmethod
    def from_setting(cls, raw: str | None) -> TokenBook:
        if not raw:
            return cls({})
        try:
            entries = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise AuthConfigError(f"LORAPLANE_AUTH_TOKENS is not JSON: {exc}") from exc
        principals = {}
        for entry in entries:
            digest = str(entry.get("sha256", "")).lower()
            role = entry.get("role")
            if len(digest) != 64 or role not in ROLES:
                raise AuthConfigError(f"bad token entry (need sha256 and role): {entry!r}")
            pattern = None
            if role == "publisher":
                parts = tuple(str(entry.get("tenant", "")).split("/"))
                if len(parts) != 3 or not all(parts):
                    raise AuthConfigError("a publisher token needs tenant 'org/team/project'")
                pattern = (parts[0], parts[1], parts[2])
            principals[digest] = Principal(digest[:12], role, pattern)
        return cls(principals)

    def __len__(self) -> int:
        return len(self._by_hash)

    def resolve(self, token: str) -> Principal | None:
        return self._by_hash.get(token_hash(token))
