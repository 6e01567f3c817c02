"""Another tenant's adapter or alias is answered exactly as a missing one on both router
fronts (gRPC NOT_FOUND, OpenAI 404 `model_not_found`, the same words), and the router's
route trace log keeps the real reason. A real router on the test's topics."""

from __future__ import annotations

import json
import logging

import grpc
import httpx
import pytest

from tests.router.conftest import (
    RIVAL,
    TOKENS,
    CatalogWriter,
    Fleet,
    collect,
    request,
)

pytestmark = pytest.mark.slow


def grpc_answer(stub: object, req: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, req, who="rival")  # type: ignore[arg-type]
    return err.value.code(), err.value.details()


def test_another_tenants_names_read_as_missing_ones_on_both_fronts(
        catalog: CatalogWriter, fleet: Fleet, make_router,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loraplane.router.trace")
    catalog.publish("acme-bot", 1)
    catalog.split("acme-line", {("acme-bot", 1): 100})
    catalog.publish("rival-bot", 1, tenant=RIVAL)
    fleet.add("w1")
    router = make_router()
    router.wait_ring({"w1"})
    stub = router.stub()
    assert collect(stub, request("rival-bot", tenant=None), who="rival")  # served: its own

    pairs = [  # (acme's name, a name nobody uses, spelt as long)
        (request("acme-line", tenant=None), request("ghost-line", tenant=None)),
        (request("acme-bot", tenant=None), request("ghost-bot", tenant=None)),
        (request(pinned=("acme-bot", 1), tenant=None),
         request(pinned=("ghost-bot", 1), tenant=None)),
    ]
    for theirs, nobodys in pairs:
        code, details = grpc_answer(stub, theirs)
        assert code == grpc.StatusCode.NOT_FOUND, details
        assert (code, details.replace("acme", "ghost")) == grpc_answer(stub, nobodys)

    headers = {"Authorization": f"Bearer {TOKENS['rival'][0]}"}
    for theirs, nobodys in (("tiny-llama:acme-line", "tiny-llama:ghost-line"),
                            ("acme-bot", "ghost-bot"), ("acme-bot@1", "ghost-bot@1")):
        answers = []
        for model in (theirs, nobodys):
            for path, body in (("/v1/completions", {"model": model, "prompt": "x"}),
                               ("/v1/chat/completions", {"model": model, "messages": [
                                   {"role": "user", "content": "x"}]})):
                got = httpx.post(router.http_url + path, json=body, headers=headers)
                answers.append((model == theirs, got.status_code,
                                got.text.replace("acme", "ghost")))
        assert {a[1] for a in answers} == {404}, answers
        assert all(json.loads(a[2])["error"]["code"] == "model_not_found" for a in answers)
        assert [a[1:] for a in answers if a[0]] == [a[1:] for a in answers if not a[0]]

    # the real reason, for the operator: a route-trace line per refused request
    reasons = [json.loads(r.getMessage()) for r in caplog.records
               if r.name == "loraplane.router.trace" and "belongs to another tenant"
               in r.getMessage()]
    assert {r["front"] for r in reasons} == {"grpc", "http"}
    assert any(r["reason"] == "adapter 'acme-bot' belongs to another tenant "
               "(acme/search/prod)" and r["answered"] == "adapter 'acme-bot' does not exist"
               and r["tenant"] == RIVAL.key for r in reasons), reasons
    assert any(r["reason"].startswith("alias 'acme-line' belongs to another tenant")
               for r in reasons), reasons
