"""Every endpoint and every refusal, over HTTP against a real registry and a real broker."""

from __future__ import annotations

import hashlib

import pytest
import torch

from services.config import Settings
from services.contracts.events import Envelope, TenantPurged, TenantRef, WorkerHeartbeat
from services.eventlog import EventProducer
from tests.registry.artifacts import (
    LLAMA_CONFIG,
    LLAMA_DIGEST,
    adapter_tarball,
    build_adapter,
    tarball,
    tensor_name,
)
from tests.registry.conftest import (
    TENANT,
    RunningRegistry,
    domain_events,
    publish,
    register_base,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def test_health_ready_metrics_and_openapi(registry: RunningRegistry) -> None:
    with registry.client(None) as anon:
        assert anon.get("/healthz").json() == {"status": "ok"}
        ready = anon.get("/readyz")
        assert ready.status_code == 200 and ready.json()["writable"] is True
        assert "loraplane_registry_ready 1.0" in anon.get("/metrics").text
        assert "/v1/adapters/{adapter_id}/versions" in anon.get("/openapi.json").json()["paths"]


def test_auth_401_vs_403(registry: RunningRegistry) -> None:
    with registry.client(None) as anon:
        response = anon.get("/v1/adapters")
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert anon.get("/v1/adapters", headers={"Authorization": "Bearer nope"}
                        ).status_code == 401
    with registry.client("worker") as worker:
        assert worker.get("/v1/adapters").status_code == 403
    with registry.client("publisher") as pub:
        assert pub.post("/v1/base-models", json={
            "name": "x", "digest": LLAMA_DIGEST, "config": {}}).status_code == 403
    with registry.client("reader") as reader:
        assert reader.get("/v1/adapters").status_code == 200
        assert reader.post("/v1/adapters/a/rollback", json={"reason": "r"}).status_code == 403


def test_base_models(registry: RunningRegistry) -> None:
    with registry.client() as admin:
        body = register_base(admin).json()
        assert body["event"]["type"] == "BaseModelRegistered" and body["event"]["offset"] >= 0
        assert admin.post("/v1/base-models", json={
            "name": "tiny-llama", "digest": LLAMA_DIGEST, "config": LLAMA_CONFIG}
        ).status_code == 409
        bad = admin.post("/v1/base-models", json={
            "name": "broken", "digest": LLAMA_DIGEST, "config": {"hidden_size": 64}})
        assert bad.status_code == 422 and "num_attention_heads" in bad.json()["detail"]
        assert [m["name"] for m in admin.get("/v1/base-models").json()] == ["tiny-llama"]
        assert admin.get("/v1/base-models/tiny-llama").json()["digest"] == LLAMA_DIGEST
        assert admin.get("/v1/base-models/nope").status_code == 404


def test_publish_two_files_and_read_back(registry: RunningRegistry) -> None:
    files = build_adapter(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                          dtype=torch.bfloat16)
    with registry.client("publisher") as pub, registry.client() as admin:
        register_base(admin)
        response = publish(pub, "support-bot", files, "v1")
        assert response.status_code == 201, response.text
        version = response.json()
        assert version["version"] == 1 and version["rank"] == 8
        assert version["sha256"] == files.sha256 and version["size_bytes"] == len(files.weights)
        assert version["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert version["dtype"] == "bfloat16" and version["tenant"] == TENANT
        assert version["event"]["offset"] >= 0 and version["event"]["seq"] == 1
        assert response.headers["etag"] == '"1"'
        adapter = pub.get("/v1/adapters/support-bot").json()
        assert adapter["latest_version"] == 1 and adapter["active_version"] is None
        got = pub.get("/v1/adapters/support-bot/versions/1").json()
        assert {k: got[k] for k in ("sha256", "label", "rank")} == {
            "sha256": files.sha256, "label": "v1", "rank": 8}
        assert pub.get("/v1/adapters/support-bot/versions/9").status_code == 404
        assert pub.get("/v1/adapters/missing").status_code == 404
    events = domain_events(registry.settings)
    published = [e for e in events if e.type == "AdapterVersionPublished"]
    assert len(published) == 1 and published[0].tenant == TenantRef(**TENANT)
    assert published[0].payload.base_model_digest == LLAMA_DIGEST


def test_publish_tarball_and_blob_download(registry: RunningRegistry) -> None:
    files = build_adapter()
    with registry.client() as admin, registry.client("worker") as worker, \
            registry.client("reader") as reader:
        register_base(admin)
        response = admin.post("/v1/adapters/tar-bot/versions", data={
            **TENANT, "owner": "o", "base_model": "tiny-llama", "label": "v1"},
            files={"archive": ("a.tar.gz", adapter_tarball(files))})
        assert response.status_code == 201, response.text
        body = response.json()
        blob = worker.get(f"/v1/blobs/sha256/{body['sha256']}")
        assert blob.status_code == 200 and blob.content == files.weights
        config = worker.get(f"/v1/blobs/sha256/{body['config_sha256']}")
        assert hashlib.sha256(config.content).hexdigest() == body["config_sha256"]
        assert reader.get(f"/v1/blobs/sha256/{body['sha256']}").status_code == 403
        assert worker.get(f"/v1/blobs/sha256/{'0' * 64}").status_code == 404
    blob_path = registry.settings.blob_dir / "sha256" / files.sha256[:2] / files.sha256
    assert blob_path.read_bytes() == files.weights


@pytest.mark.parametrize("case", ["shape", "naming", "rank", "dtype", "nan", "missing"])
def test_invalid_adapters_are_422_naming_the_tensor(registry: RunningRegistry,
                                                     case: str) -> None:
    bad = tensor_name(1, "v_proj", "B")

    def edit(t: dict[str, torch.Tensor]) -> None:
        if case == "shape":
            t[bad] = torch.zeros(31, 4, dtype=torch.float16)
        elif case == "naming":
            t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.float16)
        elif case == "nan":
            t[bad][3, 1] = float("nan")
        elif case == "missing":
            del t[bad]

    files = build_adapter(
        edit=edit, rank=200 if case == "rank" else 4,
        dtype=torch.float64 if case == "dtype" else torch.float16)
    with registry.client() as admin:
        register_base(admin)
        response = publish(admin, "bad", files, "v1")
        assert response.status_code == 422, response.text
        body = response.json()
        if case == "rank":
            assert "maximum rank" in body["detail"]
        elif case == "naming":
            assert body["tensor"] == "base_model.model.lm_head.lora_A.weight"
        else:
            assert body["tensor"] in (bad, tensor_name(0, "q_proj", "A")), body
            assert bad in body["detail"] or case == "dtype"
    assert [e.type for e in domain_events(registry.settings)] == ["BaseModelRegistered"]
    stored = [p for p in (registry.settings.blob_dir / "sha256").rglob("*") if p.is_file()]
    assert stored == []  # refused before anything was stored


def test_unknown_base_duplicate_label_and_oversize(registry: RunningRegistry) -> None:
    files = build_adapter()
    with registry.client() as admin:
        unknown = publish(admin, "a", files, "v1")
        assert unknown.status_code == 422 and "not registered" in unknown.json()["detail"]
        register_base(admin)
        assert publish(admin, "a", files, "v1").status_code == 201
        duplicate = publish(admin, "a", build_adapter(seed=2), "v1")
        assert duplicate.status_code == 409 and "label" in duplicate.json()["detail"]
        huge = admin.post("/v1/adapters/a/versions", data={**TENANT, "owner": "o",
                                                          "base_model": "tiny-llama",
                                                          "label": "big"},
                          files={"adapter_config": ("c", files.config),
                                 "adapter_model": ("m", b"\0" * (2 * 1024 * 1024))})
        assert huge.status_code == 413
        limit = registry.settings.max_upload_bytes
        over = publish(admin, "a", type(files)(files.config, b"\0" * (limit + 10)), "v9")
        assert over.status_code == 413
    assert sorted(e.type for e in domain_events(registry.settings)) == [
        "AdapterVersionPublished", "BaseModelRegistered"]


@pytest.mark.parametrize("kind", ["traversal", "absolute", "symlink", "hardlink"])
def test_hostile_tarballs_are_422(registry: RunningRegistry, kind: str) -> None:
    files = build_adapter()
    members = {"adapter_config.json": files.config, "adapter_model.safetensors": files.weights}
    if kind == "traversal":
        archive = tarball({**members, "../../etc/evil": b"x"})
    elif kind == "absolute":
        archive = tarball({**members, "/tmp/evil": b"x"})
    elif kind == "symlink":
        archive = tarball({"adapter_config.json": files.config},
                          links={"adapter_model.safetensors": "/etc/passwd"})
    else:
        archive = tarball({"adapter_config.json": files.config, "x": files.weights},
                          hardlinks={"adapter_model.safetensors": "x"})
    with registry.client() as admin:
        register_base(admin)
        response = admin.post("/v1/adapters/evil/versions", data={
            **TENANT, "owner": "o", "base_model": "tiny-llama", "label": "v1"},
            files={"archive": ("a.tar.gz", archive)})
        assert response.status_code == 422, response.text


def test_tenant_scope_on_writes(registry: RunningRegistry) -> None:
    with registry.client() as admin, registry.client("rival") as rival, \
            registry.client("publisher") as pub:
        register_base(admin)
        assert publish(rival, "a", build_adapter(), "v1").status_code == 403
        assert publish(pub, "a", build_adapter(), "v1").status_code == 201
        # another tenant's adapter is answered as a missing one (test_tenancy.py: alike)
        assert rival.put("/v1/adapters/a/active", json={"version": 1}).status_code == 404
        assert rival.post("/v1/adapters/a/versions/1/disable", json={}).status_code == 404
        assert rival.put("/v1/aliases/al", json={"split": [
            {"adapter_id": "a", "version": 1, "weight": 100}]}).status_code == 422
        assert rival.post("/v1/tenants/acme/search/prod/purge", json={}).status_code == 403
        assert rival.get("/v1/adapters/a").status_code == 404
        assert rival.get("/v1/adapters").json()["items"] == []


def test_if_match_idempotency_and_pagination(registry: RunningRegistry) -> None:
    with registry.client("publisher") as pub, registry.client() as admin:
        register_base(admin)
        assert publish(pub, "a", build_adapter(), "v1").status_code == 201
        stale = publish(pub, "a", build_adapter(seed=1), "v2", headers={"If-Match": '"0"'})
        assert stale.status_code == 412
        ok = publish(pub, "a", build_adapter(seed=1), "v2", headers={"If-Match": '"1"'})
        assert ok.status_code == 201
        key = {"Idempotency-Key": "publish-v3-once"}
        first = publish(pub, "a", build_adapter(seed=3), "v3", headers=key)
        again = publish(pub, "a", build_adapter(seed=3), "v3", headers=key)
        assert first.status_code == again.status_code == 201
        assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
        other_use = pub.post("/v1/adapters/a/rollback", json={"reason": "r"}, headers=key)
        assert other_use.status_code == 422
        for n in range(3):
            assert publish(pub, f"z{n}", build_adapter(seed=n), "v1").status_code == 201
        page = pub.get("/v1/adapters", params={"limit": 2}).json()
        assert [a["adapter_id"] for a in page["items"]] == ["a", "z0"]
        page2 = pub.get("/v1/adapters", params={"limit": 2, "cursor": page["next_cursor"]})
        assert [a["adapter_id"] for a in page2.json()["items"]] == ["z1", "z2"]
        versions = pub.get("/v1/adapters/a/versions", params={"limit": 2}).json()
        assert [v["version"] for v in versions["items"]] == [1, 2]
        rest = pub.get("/v1/adapters/a/versions", params={"cursor": versions["next_cursor"]})
        assert [v["version"] for v in rest.json()["items"]] == [3]
    published = [e for e in domain_events(registry.settings)
                 if e.type == "AdapterVersionPublished" and e.stream == "adapter/a"]
    assert [e.payload.version for e in published] == [1, 2, 3]
    assert [e.seq for e in published] == [1, 2, 3]


def test_switch_split_rollback_disable_enable(registry: RunningRegistry) -> None:
    with registry.client("publisher") as pub, registry.client() as admin:
        register_base(admin)
        for n in (1, 2, 3):
            assert publish(pub, "bot", build_adapter(seed=n), f"v{n}").status_code == 201
        assert pub.post("/v1/adapters/bot/rollback", json={"reason": "x"}).status_code == 409
        switched = pub.put("/v1/adapters/bot/active", json={"version": 1})
        assert switched.status_code == 200 and switched.json()["to_version"] == 1
        # canary of v2 through an alias: 5 → 25 → 50 → 100
        for weight in (5, 25, 50, 100):
            split = [{"adapter_id": "bot", "version": 2, "weight": weight}]
            if weight < 100:
                split.append({"adapter_id": "bot", "version": 1, "weight": 100 - weight})
            response = pub.put("/v1/aliases/bot-prod", json={"split": split})
            assert response.status_code == 200, response.text
        assert pub.get("/v1/aliases/bot-prod").json()["etag"] == 4
        assert pub.put("/v1/aliases/bot-prod", json={"split": [
            {"adapter_id": "bot", "version": 2, "weight": 60}]}).status_code == 422
        assert pub.put("/v1/aliases/bot-prod", headers={"If-Match": '"2"'}, json={"split": [
            {"adapter_id": "bot", "version": 2, "weight": 100}]}).status_code == 412
        assert pub.get("/v1/aliases").json()["items"][0]["alias"] == "bot-prod"
        assert pub.put("/v1/adapters/bot/active", json={"version": 3}).status_code == 200
        # 100% of an alias is not a switch: v2 is not stable yet
        assert pub.get("/v1/adapters/bot").json()["rollback_target"] == 1
        # finishing the canary is an explicit switch, and that makes v2 stable
        assert pub.put("/v1/adapters/bot/active", json={"version": 2}).status_code == 200
        assert pub.put("/v1/adapters/bot/active", json={"version": 3}).status_code == 200
        adapter = pub.get("/v1/adapters/bot").json()
        assert adapter["rollback_target"] == 2
        rolled = pub.post("/v1/adapters/bot/rollback", json={"reason": "p99 latency"})
        assert rolled.status_code == 200, rolled.text
        assert (rolled.json()["from_version"], rolled.json()["to_version"]) == (3, 2)
        disabled = pub.post("/v1/adapters/bot/versions/3/disable", json={"reason": "bad"})
        assert disabled.status_code == 200
        assert pub.post("/v1/adapters/bot/versions/3/disable", json={}).status_code == 409
        assert pub.put("/v1/aliases/bot-prod", json={"split": [
            {"adapter_id": "bot", "version": 3, "weight": 100}]}).status_code == 409
        assert pub.post("/v1/adapters/bot/rollback", json={"reason": "r", "to_version": 3}
                        ).status_code == 409
        assert pub.get("/v1/adapters/bot/versions/3").json()["disabled"] is True
        assert pub.post("/v1/adapters/bot/versions/3/enable", json={}).status_code == 200
        explicit = pub.post("/v1/adapters/bot/rollback", json={"reason": "r", "to_version": 1})
        assert explicit.json()["to_version"] == 1
    types = [e.type for e in domain_events(registry.settings)]
    assert types.count("TrafficSplitChanged") == 4 and types.count("AdapterRolledBack") == 2


def test_purge_reports_worker_acks_and_deadline(registry: RunningRegistry,
                                                reg_settings: Settings) -> None:
    with EventProducer(reg_settings, client_id="fake-worker") as worker_log:
        for worker in ("w1", "w2"):
            worker_log.publish(Envelope.new(WorkerHeartbeat(
                worker_id=worker, address="127.0.0.1:1", base_model="tiny-llama",
                base_model_digest=LLAMA_DIGEST), stream=f"worker/{worker}", seq=1, actor=worker))
        with registry.client("publisher") as pub:
            # heartbeats are folded before the purge is decided: wait until both are seen
            wait_for(lambda: len(registry.node.state.heartbeats) >= 2, 10,
                     message="both heartbeats folded")
            response = pub.post("/v1/tenants/acme/search/prod/purge", json={"deadline_s": 30})
            assert response.status_code == 202, response.text
            purge = response.json()
            assert purge["status"] == "pending" and purge["expected_workers"] == ["w1", "w2"]
            purge_id = purge["purge_id"]
            for n, worker in enumerate(("w1", "w2")):
                worker_log.publish(Envelope.new(TenantPurged(
                    worker_id=worker, purge_id=purge_id, kv_blocks_freed=3, adapters_unloaded=1,
                    refcounts_zero=True), stream=f"worker/{worker}", seq=2, actor=worker,
                    tenant=TenantRef(**TENANT)))
                status = wait_for(
                    lambda n=n: len((s := pub.get(f"/v1/purges/{purge_id}").json())["acks"])
                    == n + 1 and s, 10, message=f"ack {n + 1} in the purge's status")
            assert status["status"] == "met" and all(a["on_time"] for a in status["acks"])
            assert pub.get("/v1/purges/nope").status_code == 404
    purges = [e for e in domain_events(reg_settings) if e.type == "TenantPurgeRequested"]
    assert purges[0].tenant == TenantRef(**TENANT) and purges[0].payload.deadline_s == 30
