"""Who may do what: the one table of token roles and their permissions.

The registry's routes, the router's gRPC RPCs and its OpenAI HTTP routes each declare
one permission, and a token's role decides whether it holds it: nothing else does. Least
privilege: each role holds what its holder needs and nothing more, so a leaked publisher
token runs no inference and a leaked inference token changes nothing in the registry.
A tenant-scoped role (publisher, inference) holds its permissions only for the tenants
its org/team/project pattern covers; that check is the caller's (`Principal.in_scope`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

Role = Literal["admin", "publisher", "reader", "worker", "inference", "canary"]


class Permission(StrEnum):
    READ = "read"
    """Catalog reads: adapters, versions, aliases, base models, gates, rollouts, purges."""
    PUBLISH = "publish"
    """Change a tenant's adapters: publish, switch, roll back, disable, enable, set a
    traffic split, request a quality gate, start or resume a canary rollout."""
    PURGE = "purge"
    """Purge a tenant (its adapters, KV and blobs)."""
    STEP_ROLLOUT = "step_rollout"
    """Advance, roll back or halt a canary rollout (each step re-judged on its figures)."""
    REGISTER_BASE_MODEL = "register_base_model"
    OVERRIDE_RELEASE = "override_release"
    """Let a version get traffic despite its quality gate or a canary rollback."""
    FETCH_BLOB = "fetch_blob"
    """Download adapter files and regression sets by digest (what a worker loads)."""
    INFER = "infer"
    """Generate through the router (gRPC and OpenAI HTTP), list the models one may use."""


ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    "admin": frozenset(Permission),
    "publisher": frozenset({Permission.READ, Permission.PUBLISH, Permission.PURGE,
                            Permission.STEP_ROLLOUT}),
    "reader": frozenset({Permission.READ}),
    "worker": frozenset({Permission.FETCH_BLOB}),
    "inference": frozenset({Permission.INFER}),
    "canary": frozenset({Permission.STEP_ROLLOUT}),
}
"""Role → what it may do. docs/registry.md's table of roles is this one."""

ROLES: tuple[Role, ...] = tuple(ROLE_PERMISSIONS)
TENANT_SCOPED: tuple[Role, ...] = ("publisher", "inference")
"""Roles whose token names the tenants it acts for (`org/team/project`, `*` = any)."""


def may(role: str, permission: Permission) -> bool:
    """Does a token of `role` hold `permission` (an unknown role holds nothing)?"""
    return permission in ROLE_PERMISSIONS.get(role, frozenset())  # type: ignore[call-overload]


def holders(permission: Permission) -> tuple[Role, ...]:
    """The roles that hold `permission`, for refusals that say who may."""
    return tuple(role for role in ROLES if permission in ROLE_PERMISSIONS[role])
