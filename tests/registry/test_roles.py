"""A token's role decides what it may do in the registry: every route declares one
permission of the roles table (`services/contracts/roles.py`), and a walk of every role
over every route, on a real registry, finds each allowed exactly when the table says so.
A route added without a declared permission fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts

from services.catalog.auth import token_hash
from services.config import Settings
from services.contracts.roles import ROLE_PERMISSIONS, ROLES, Permission
from services.registry.deps import Allowed
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import RunningRegistry, publish, register_base, registry_settings

pytestmark = pytest.mark.slow

TOKENS = {role: f"{role}-token" for role in ROLES}
SCOPED = {"publisher": "acme/search/prod", "inference": "acme/search/prod"}
PUBLIC = {"/healthz", "/readyz", "/metrics"}
"""Routes every caller may use: liveness, readiness and metrics, no catalog data."""


def permission_of(dependant: Dependant) -> set[Permission]:
    """Every permission the route's dependencies declare (`Allowed`), however nested."""
    found = set()
    for dependency in dependant.dependencies:
        if isinstance(dependency.call, Allowed):
            found.add(dependency.call.permission)
        found |= permission_of(dependency)
    return found


def as_role(registry: RunningRegistry, role: str) -> httpx.Client:
    return httpx.Client(base_url=registry.url, timeout=30,
                        headers={"Authorization": f"Bearer {TOKENS[role]}"})


def routes(app: FastAPI) -> list[tuple[str, str, Permission | None]]:
    """(method, path template, its permission) of every route the app serves."""
    table = []
    for route in iter_route_contexts(app.routes):
        if not isinstance(route.original_route, APIRoute):
            continue  # FastAPI's own OpenAPI document and docs pages
        declared = permission_of(route.dependant)
        assert len(declared) <= 1, (route.path, declared)
        for method in sorted(route.methods or ()):
            table.append((method, str(route.path), next(iter(declared), None)))
    return table


def test_every_role_may_do_what_the_table_says_on_every_route(
        settings: Settings, tmp_path: Path) -> None:
    auth = json.dumps([{"sha256": token_hash(token), "role": role,
                        **({"tenant": SCOPED[role]} if role in SCOPED else {})}
                       for role, token in TOKENS.items()])
    registry = RunningRegistry(registry_settings(settings, tmp_path / "blobs",
                                                 auth_tokens=auth)).start()
    try:
        table = routes(registry.app)
        undeclared = [(m, p) for m, p, perm in table if perm is None and p not in PUBLIC]
        assert not undeclared, f"routes without a declared permission: {undeclared}"
        with as_role(registry, "admin") as admin, as_role(registry, "publisher") as acme:
            register_base(admin)
            files = build_adapter(seed=1)
            for n in (1, 2):
                assert publish(acme, "walk-bot", build_adapter(seed=n), f"v{n}"
                               ).status_code == 201
            purge_id = admin.post("/v1/tenants/acme/search/other/purge", json={}
                                  ).json()["purge_id"]
        values = {"adapter_id": "walk-bot", "version": "1", "alias": "walk-line",
                  "digest": files.sha256, "org": "acme", "team": "search",
                  "project": "prod", "purge_id": purge_id, "name": "tiny-llama"}
        walked = 0
        for method, template, permission in table:
            if permission is None:
                continue
            path = re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values[m[1]], template)
            for role in ROLES:
                kw: dict[str, Any] = {} if method in ("GET", "DELETE") else {"json": {}}
                with as_role(registry, role) as client:
                    got = client.request(method, path, **kw)
                allowed = permission in ROLE_PERMISSIONS[role]
                if allowed:
                    assert got.status_code not in (401, 403), (role, method, path, got.text)
                else:
                    assert got.status_code == 403, (role, method, path, got.text)
                    assert f"role {role} may not {permission.value}" in got.json()["detail"]
                walked += 1
        assert walked == len(ROLES) * sum(1 for *_, p in table if p is not None) > 100
    finally:
        registry.stop()
