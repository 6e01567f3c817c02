"""Bearer tokens, stored only as SHA-256 hashes, mapped to a role and (for publishers and
inference callers) a tenant.

What each role may do is the table in `services.contracts.roles`; a tenant-scoped token
(publisher, inference) holds its permissions for its own org/team/project only (a `*`
segment matches any). An inference token may carry the tenant's `qos_tier` (the router's
limits and scheduling tier). An unknown or missing token is 401; a known token whose role
lacks the permission is 403.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from services.contracts.events import TenantRef
from services.contracts.roles import ROLES, TENANT_SCOPED, Permission, Role, may

__all__ = ["ROLES", "TENANT_SCOPED", "AuthConfigError", "Permission", "Principal", "Role",
           "TokenBook", "token_hash"]
QOS_TIERS = ("platinum", "gold", "silver", "bronze")


class AuthConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    """Who is calling. `actor` goes into each event's envelope and scopes idempotency keys."""

    token_id: str
    role: Role
    tenant_pattern: tuple[str, str, str] | None = None
    qos_tier: str | None = None
    """The tenant's paid tier for an inference token; None = the router's default."""

    @property
    def actor(self) -> str:
        return f"{self.role}:{self.token_id}"

    def holds(self, permission: Permission) -> bool:
        """Does the token's role carry `permission` (for some tenant at least)?"""
        return may(self.role, permission)

    def allows(self, permission: Permission, tenant: TenantRef | None) -> bool:
        """May this token do `permission` on a resource of `tenant` (None: a resource of no
        tenant, which a tenant-scoped token never covers)?"""
        if not may(self.role, permission):
            return False
        if self.role not in TENANT_SCOPED:
            return True
        return tenant is not None and self.in_scope(tenant)

    def may_write_for(self, tenant: TenantRef | None) -> bool:
        return self.allows(Permission.PUBLISH, tenant)

    def may_infer_for(self, tenant: TenantRef) -> bool:
        return self.allows(Permission.INFER, tenant)

    def in_scope(self, tenant: TenantRef) -> bool:
        """Does the token's org/team/project pattern cover `tenant` (`*` matches any)?"""
        if self.tenant_pattern is None:
            return False
        return all(p in ("*", v) for p, v in
                   zip(self.tenant_pattern, (tenant.org, tenant.team, tenant.project),
                       strict=True))

    def may_read_for(self, tenant: TenantRef | None) -> bool:
        return self.allows(Permission.READ, tenant)


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
            if role in TENANT_SCOPED:
                parts = tuple(str(entry.get("tenant", "")).split("/"))
                if len(parts) != 3 or not all(parts):
                    raise AuthConfigError(f"a {role} token needs tenant 'org/team/project'")
                pattern = (parts[0], parts[1], parts[2])
            tier = entry.get("qos_tier")
            if tier is not None and tier not in QOS_TIERS:
                raise AuthConfigError(f"bad qos_tier {tier!r} (one of {', '.join(QOS_TIERS)})")
            principals[digest] = Principal(digest[:12], role, pattern, tier)
        return cls(principals)

    def __len__(self) -> int:
        return len(self._by_hash)

    def resolve(self, token: str) -> Principal | None:
        return self._by_hash.get(token_hash(token))
