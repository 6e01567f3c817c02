"""One error contract (RFC 9457 problem+json with a stable code), idempotency as the IETF
draft says, the declared base model, and blobs that are never served corrupt."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.config import Settings
from services.contracts.problems import PROBLEM_MEDIA_TYPE, TYPE_PREFIX
from services.registry.app import create_app
from services.registry.validation import MAX_CONFIG_BYTES
from tests.registry.artifacts import adapter_tarball, build_adapter, tarball
from tests.registry.conftest import (
    TENANT,
    RunningRegistry,
    domain_events,
    publish,
    register_base,
)

pytestmark = pytest.mark.slow


def problem(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == PROBLEM_MEDIA_TYPE, answer.headers
    body = answer.json()
    assert body["status"] == status and body["code"] == code, body
    assert body["type"] == f"{TYPE_PREFIX}{code}" and body["title"] and body["detail"], body
    return body


def test_every_error_is_a_problem_with_a_stable_code(registry: RunningRegistry) -> None:
    with registry.client() as admin, registry.client(None) as anon, \
            registry.client("reader") as reader:
        register_base(admin)
        assert publish(admin, "bot", build_adapter(), "v1").status_code == 201
        problem(anon.get("/v1/adapters"), 401, "unauthorized")
        problem(reader.put("/v1/adapters/bot/active", json={"version": 1}), 403, "forbidden")
        body = problem(admin.get("/v1/adapters/missing"), 404, "not_found")
        assert body["instance"] == "/v1/adapters/missing"
        problem(admin.get("/v1/nowhere"), 404, "not_found")
        problem(admin.delete("/v1/adapters"), 405, "method_not_allowed")
        problem(publish(admin, "bot", build_adapter(seed=1), "v1"), 409, "conflict")
        problem(admin.put("/v1/adapters/bot/active", json={"version": 1},
                          headers={"If-Match": '"7"'}), 412, "precondition")
        bad_etag = problem(admin.put("/v1/adapters/bot/active", json={"version": 1},
                                     headers={"If-Match": "yesterday"}), 412, "precondition")
        assert bad_etag["field"] == "If-Match header"
        problem(admin.post("/v1/adapters/bot/versions", content=b"x" * (2 * 1024 * 1024),
                           headers={"content-type": "application/octet-stream"}),
                413, "too_large")

        # validation of path, form and body: a message a person can act on, and the field
        slug = problem(publish(admin, "bot", build_adapter(seed=2), "v2", org="Acme!"),
                       422, "invalid_request")
        assert slug["field"] == "org"
        assert "lowercase letters, digits, '.', '_', '-'" in slug["detail"], slug
        assert "^[a-z0-9]" not in json.dumps(slug)
        path = problem(admin.get("/v1/adapters/Bad%20Id"), 422, "invalid_request")
        assert path["field"] == "adapter_id" and "lowercase letters" in path["detail"]
        split = problem(admin.put("/v1/aliases/a", json={"split": [
            {"adapter_id": "bot", "version": 1, "weight": 101}]}), 422, "invalid_request")
        assert split["field"] == "split[0].weight"
        assert "less than or equal to 100" in split["detail"]
        missing = problem(admin.post("/v1/adapters/bot/rollback", json={}), 422,
                          "invalid_request")
        assert missing["errors"] == [{"field": "reason", "message": "is required"}]


def test_the_openapi_document_declares_the_problem_for_every_error(tmp_path: Path) -> None:
    document = create_app(Settings(blob_dir=tmp_path / "blobs")).openapi()
    schemas = document["components"]["schemas"]
    assert "Problem" in schemas and "HTTPValidationError" not in schemas
    assert set(schemas["Problem"]["required"]) >= {"type", "title", "status", "detail", "code"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            if operation.get("parameters") or operation.get("requestBody"):
                assert "422" in responses, (method, path)
            errors = {s: r for s, r in responses.items() if int(s) >= 400}
            assert "500" in errors, (method, path)
            for status, response in errors.items():
                assert list(response["content"]) == [PROBLEM_MEDIA_TYPE], (method, path, status)
                assert response["content"][PROBLEM_MEDIA_TYPE]["schema"] == {
                    "$ref": "#/components/schemas/Problem"}


def test_upload_problems_say_what_is_wrong(registry: RunningRegistry) -> None:
    files = build_adapter()
    with registry.client() as admin:
        register_base(admin)
        truncated = problem(publish(admin, "bot", type(files)(files.config, files.weights[:-10]),
                                    "v1"), 422, "invalid_adapter")
        assert "truncated" in truncated["detail"], truncated
        cut_header = problem(publish(admin, "bot", type(files)(files.config, files.weights[:40]),
                                     "v1"), 422, "invalid_adapter")
        assert "truncated" in cut_header["detail"] and cut_header["field"] == "adapter_model"

        big = json.dumps({**json.loads(files.config), "pad": "x" * MAX_CONFIG_BYTES}).encode()
        as_file = problem(publish(admin, "bot", type(files)(big, files.weights), "v1"), 413,
                          "too_large")
        assert as_file["field"] == "adapter_config"
        in_archive = problem(admin.post("/v1/adapters/bot/versions", data={
            **TENANT, "owner": "o", "base_model": "tiny-llama", "label": "v1"},
            files={"archive": ("a.tar.gz", tarball({"adapter_config.json": big,
                                                    "adapter_model.safetensors": files.weights}))}),
            413, "too_large")
        assert in_archive["field"] == "adapter_config"
    assert [e.type for e in domain_events(registry.settings)] == ["BaseModelRegistered"]


def test_a_reused_idempotency_key_with_another_request_is_422(registry: RunningRegistry) -> None:
    with registry.client("publisher") as pub, registry.client() as admin:
        register_base(admin)
        key = {"Idempotency-Key": "publish-once"}
        first = publish(pub, "bot", build_adapter(seed=1), "v1", headers=key)
        assert first.status_code == 201
        # the same request, sent as an archive this time: the same files, so the same answer
        same = pub.post("/v1/adapters/bot/versions", headers=key, data={
            **TENANT, "owner": "alice@acme", "base_model": "tiny-llama", "label": "v1"},
            files={"archive": ("a.tar.gz", adapter_tarball(build_adapter(seed=1)))})
        assert same.status_code == 201 and same.json() == first.json()
        assert same.headers["idempotent-replayed"] == "true"
        other = problem(publish(pub, "bot", build_adapter(seed=2), "v1", headers=key), 422,
                        "key_reused")
        assert "different request" in other["detail"]
        problem(publish(pub, "bot", build_adapter(seed=1), "v1-renamed", headers=key), 422,
                "key_reused")
        switch = {"Idempotency-Key": "switch-once"}
        assert pub.put("/v1/adapters/bot/active", json={"version": 1},
                       headers=switch).status_code == 200
        assert pub.put("/v1/adapters/bot/active", json={"version": 1},
                       headers=switch).status_code == 200
        problem(pub.post("/v1/adapters/bot/rollback", json={"reason": "x"}, headers=switch),
                422, "key_reused")
    published = [e for e in domain_events(registry.settings)
                 if e.type == "AdapterVersionPublished"]
    assert len(published) == 1 and published[0].payload.request_sha256


def test_the_declared_base_model_is_kept_and_named(registry: RunningRegistry) -> None:
    def declaring(name: str, **kwargs: Any) -> Any:
        return build_adapter(config_edit=lambda c: c.__setitem__("base_model_name_or_path",
                                                                 name), **kwargs)

    with registry.client() as admin:
        register_base(admin)
        same = publish(admin, "bot", declaring("/models/Tiny-Llama/"), "v1")
        assert same.status_code == 201 and same.json()["warnings"] == []
        other = publish(admin, "bot", declaring("meta-llama/Llama-3.1-8B", seed=1), "v2")
        assert other.status_code == 201, other.text
        body = other.json()
        assert body["declared_base_model"] == "meta-llama/Llama-3.1-8B"
        assert len(body["warnings"]) == 1 and "meta-llama/Llama-3.1-8B" in body["warnings"][0]
        assert admin.get("/v1/adapters/bot/versions/2").json()["declared_base_model"] == \
            "meta-llama/Llama-3.1-8B"
        misfit = problem(publish(admin, "bot", declaring(
            "meta-llama/Llama-3.1-8B", seed=2, targets=("q_proj",),
            edit=lambda t: t.update({k: v[:, :32].contiguous() for k, v in t.items()
                                     if "lora_A" in k})),
            "v3"), 422, "invalid_adapter")
        assert "meta-llama/Llama-3.1-8B" in misfit["detail"] and "tiny-llama" in misfit["detail"]
        assert misfit["declared_base_model"] == "meta-llama/Llama-3.1-8B" and misfit["tensor"]
    events = [e for e in domain_events(registry.settings) if e.type == "AdapterVersionPublished"]
    assert [e.payload.declared_base_model for e in events] == [
        "/models/Tiny-Llama/", "meta-llama/Llama-3.1-8B"]


def test_a_corrupt_blob_is_never_served(registry: RunningRegistry) -> None:
    files = build_adapter()
    with registry.client() as admin, registry.client("worker") as worker:
        register_base(admin)
        assert publish(admin, "bot", files, "v1").status_code == 201
        path = registry.settings.blob_root / "sha256" / files.sha256[:2] / files.sha256
        good = worker.get(f"/v1/blobs/sha256/{files.sha256}")
        assert good.status_code == 200 and hashlib.sha256(good.content).hexdigest() == \
            files.sha256

        # bit rot: same size, same mtime, one byte flipped
        stat = path.stat()
        rotten = bytearray(path.read_bytes())
        rotten[len(rotten) // 2] ^= 0xFF
        path.write_bytes(bytes(rotten))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(httpx.HTTPError), worker.stream(
                "GET", f"/v1/blobs/sha256/{files.sha256}") as cut:
            received = b"".join(cut.iter_raw())
            assert len(received) < len(files.weights)  # never the whole of it

        # corrupted file, found before anything is sent
        path.write_bytes(bytes(rotten))
        refused = problem(worker.get(f"/v1/blobs/sha256/{files.sha256}"), 500,
                          "blob_corrupted")
        assert files.sha256 in refused["detail"]
