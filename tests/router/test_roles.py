"""A token's role decides what it may do on the router: every RPC of its Inference service
and every OpenAI HTTP route declares one permission of the roles table
(`services/contracts/roles.py`), and a walk of every role over each, on a real router in
front of a worker, finds it allowed exactly when the table says so. Inference is least
privilege: only inference and admin tokens run it (a publisher's token used to)."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from services.catalog.auth import token_hash
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.roles import ROLE_PERMISSIONS, ROLES, Permission, holders
from services.router.openai_http import Allowed
from services.router.openai_routes import create_http_app
from services.router.server import RPC_PERMISSIONS
from tests.router.conftest import ACME, CatalogWriter, Fleet, request

pytestmark = pytest.mark.slow

TOKENS = {role: f"{role}-token" for role in ROLES}
SCOPED = {"publisher": "acme/search/prod", "inference": "acme/search/prod"}
PUBLIC = {"/healthz", "/readyz", "/metrics"}
"""Routes every caller may use: liveness, readiness and metrics."""


def auth() -> str:
    return json.dumps([{"sha256": token_hash(token), "role": role,
                        **({"tenant": SCOPED[role]} if role in SCOPED else {})}
                       for role, token in TOKENS.items()])


def http_routes(router: Any) -> list[tuple[str, str, Permission | None]]:
    """(method, path, permission) of every route of the router's HTTP app."""
    table = []
    app = create_http_app(router.dispatcher, router.app.tokens)
    for route in iter_route_contexts(app.routes):
        if not isinstance(route.original_route, APIRoute):
            continue
        declared = {d.call.permission for d in route.dependant.dependencies
                    if isinstance(d.call, Allowed)}
        assert len(declared) <= 1, (route.path, declared)
        for method in sorted(route.methods or ()):
            table.append((method, str(route.path), next(iter(declared), None)))
    return table


def test_inference_is_for_inference_and_admin_tokens_only() -> None:
    assert set(holders(Permission.INFER)) == {"admin", "inference"}
    assert not any(Permission.INFER in ROLE_PERMISSIONS[r]
                   for r in ("publisher", "reader", "worker", "canary"))


def test_every_role_may_do_what_the_table_says_on_both_fronts(
        catalog: CatalogWriter, fleet: Fleet, make_router) -> None:
    catalog.publish("acme-bot", 1)
    fleet.add("w1")
    router = make_router(auth_tokens=auth())
    router.wait_ring({"w1"})

    rpcs = pb.DESCRIPTOR.services_by_name["Inference"].methods_by_name
    assert set(rpcs) == set(RPC_PERMISSIONS), "every RPC declares its permission"
    stub = router.stub()
    sig = request("acme-bot", tenant=ACME).tenant
    calls = {"Generate": lambda metadata: list(stub.Generate(
        request("acme-bot", tenant=ACME), metadata=metadata, timeout=10)),
        "Tokenize": lambda metadata: [stub.Tokenize(pb.TokenizeRequest(
            tenant=sig, base_model="tiny-llama", text="x"), metadata=metadata, timeout=10)],
        "Detokenize": lambda metadata: [stub.Detokenize(pb.DetokenizeRequest(
            tenant=sig, base_model="tiny-llama", token_ids=[120]), metadata=metadata,
            timeout=10)],
        "ModelInfo": lambda metadata: [stub.ModelInfo(pb.ModelInfoRequest(tenant=sig),
                                                      metadata=metadata, timeout=10)]}
    assert set(calls) == set(rpcs)
    for rpc, permission in RPC_PERMISSIONS.items():
        for role in ROLES:
            metadata = (("authorization", f"Bearer {TOKENS[role]}"),)
            if permission in ROLE_PERMISSIONS[role]:
                answer = calls[rpc](metadata)[-1]
                assert rpc != "Generate" or answer.HasField("final"), (rpc, role)
            else:
                with pytest.raises(grpc.RpcError) as err:
                    calls[rpc](metadata)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc, role)
                assert f"role {role} may not {permission.value}" in err.value.details()

    table = http_routes(router)
    undeclared = [(m, p) for m, p, perm in table if perm is None and p not in PUBLIC]
    assert not undeclared, f"routes without a declared permission: {undeclared}"
    bodies = {"/v1/completions": {"model": "acme-bot", "prompt": "x", "max_tokens": 2},
              "/v1/chat/completions": {"model": "acme-bot", "max_tokens": 2, "messages": [
                  {"role": "user", "content": "x"}]},
              "/tokenize": {"model": "acme-bot", "prompt": "x"},
              "/detokenize": {"model": "tiny-llama", "tokens": [120]}}
    walked = 0
    for method, template, permission in table:
        if permission is None:
            continue
        path = re.sub(r"\{(\w+)(?::\w+)?\}", "tiny-llama", template)
        for role in ROLES:
            got = httpx.request(method, router.http_url + path, json=bodies.get(template),
                                headers={"Authorization": f"Bearer {TOKENS[role]}",
                                         "X-Loraplane-Tenant": ACME.key})
            if permission in ROLE_PERMISSIONS[role]:
                assert got.status_code == 200, (role, method, path, got.text)
            else:
                assert got.status_code == 403, (role, method, path, got.text)
                assert got.json()["error"]["code"] == "forbidden"
            walked += 1
    assert walked == len(ROLES) * 7
