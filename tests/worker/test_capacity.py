"""One capacity rule, pinned: what the registry accepts, a worker holds and serves.

Adapters at the edges of every limit both check (rank, dtype, target modules) and
regression sets at the edge of the context a worker serves are published over HTTP to a
real registry and handed to the real worker loader and engine (on the tiny random base
model, sized by the same settings); the registry's verdict equals the worker's for each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.config import Settings
from services.contracts.grpc import inference_pb2 as pb
from services.worker.app import checked_parser, engine_config, prompt_rules
from services.worker.engine import (
    AdapterFiles,
    Engine,
    EngineError,
    GenerationRequest,
    SamplingParams,
    checkpoint_digest,
)
from services.worker.intake import InvalidArgument, work_item
from tests.registry.artifacts import build_adapter, tensor_name
from tests.registry.conftest import RunningRegistry, publish, registry_settings
from tests.worker.conftest import ServedModel

pytestmark = pytest.mark.slow

RANK = 8
CONTEXT = 64
"""The fleet's settings below: pools of rank 8, 16 KV blocks of 4 tokens (the tiny model's
max_position_embeddings is 1024, so its context is the KV cache's 64 tokens)."""
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def mixed(tensors: dict[str, torch.Tensor]) -> None:
    name = tensor_name(0, "q_proj", "A")
    tensors[name] = tensors[name].to(torch.float32)


def extra_module(config: dict[str, Any]) -> None:
    config["target_modules"] = ["q_proj", "v_proj", "c_attn"]  # not a Llama module


def narrower(config: dict[str, Any]) -> None:
    config["target_modules"] = ["q_proj"]


ADAPTERS: dict[str, dict[str, Any]] = {
    "rank-1": {"rank": 1},
    "rank-at-limit": {"rank": RANK, "targets": ALL},
    "rank-over-limit": {"rank": RANK + 1},
    "rank-far-over": {"rank": 4 * RANK},
    "float16": {"dtype": torch.float16},
    "bfloat16": {"dtype": torch.bfloat16},
    "float32": {"dtype": torch.float32},
    "float64": {"dtype": torch.float64},
    "mixed-dtypes": {"edit": mixed},
    "all-projections": {"targets": ALL},
    "foreign-module-target": {"config_edit": extra_module},
    "tensor-outside-targets": {"config_edit": narrower},
}

LIMIT = {"rank-over-limit": "max_lora_rank", "rank-far-over": "max_lora_rank",
         "float64": "dtype", "mixed-dtypes": "dtype", "foreign-module-target": "target_modules"}

CASES = {  # (prompt: token ids or text, max_tokens)
    "fills-context": ([5] * (CONTEXT - 4), 4),
    "one-over": ([5] * (CONTEXT - 3), 4),
    "long-answer": ([5], CONTEXT - 1),
    "longer-answer": ([5], CONTEXT),
    "text-fills": ("w5", CONTEXT - 1),
    "text-over": ("w5", CONTEXT),
}


@pytest.fixture
def fleet(settings: Settings, tmp_path: Path, served_model: ServedModel
          ) -> tuple[Settings, RunningRegistry, Engine]:
    """The settings the registry shares with the workers, the registry, and a worker's
    engine built from those same settings."""
    shared = registry_settings(settings, tmp_path / "blobs", max_upload_bytes=4 << 20,
                               worker_max_lora_rank=RANK, worker_kv_blocks=CONTEXT // 4,
                               worker_block_size=4, worker_adapter_slots=2,
                               worker_dtype="float32", worker_device="cpu")
    registry = RunningRegistry(shared).start()
    engine = Engine.from_pretrained(served_model.path, engine_config(shared))
    config = json.loads((served_model.path / "config.json").read_text())
    with registry.client() as admin:
        answer = admin.post("/v1/base-models", json={
            "name": "tiny-llama", "digest": checkpoint_digest(served_model.path),
            "config": config})
        assert answer.status_code == 201, answer.text
    yield shared, registry, engine
    registry.stop()


def worker_serves_adapter(shared: Settings, engine: Engine, config: bytes,
                          weights: bytes) -> bool:
    """The worker's loader path: parse and check (as a fetched adapter is), place in the
    pool, generate with it."""
    files = AdapterFiles(config, weights)
    digest = files.digest()
    try:
        adapter = checked_parser(shared, engine)(files, digest)
        engine.adapters.place(adapter)
    except EngineError:
        return False
    try:
        [result] = engine.generate([GenerationRequest(
            prompt_token_ids=[5, 6, 7], adapter_digest=digest,
            sampling=SamplingParams(max_tokens=2, ignore_eos=True))])
        assert len(result.token_ids) == 2
    finally:
        engine.unload_adapter(digest)
    return True


def worker_runs_case(shared: Settings, engine: Engine, model_dir: Path,
                     prompt: list[int] | str, max_tokens: int) -> bool:
    """A case is a request: the worker's intake takes it, and the engine generates it."""
    request = pb.GenerateRequest(tenant=pb.TenantSignature(org_id="acme", team_id="search",
                                                           project_id="prod"),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    try:
        work = work_item(request, prompt_rules(shared, engine, model_dir))
    except InvalidArgument:
        return False
    [result] = engine.generate([GenerationRequest(prompt_token_ids=work.prompt_ids,
                                                  sampling=work.sampling)])
    assert len(result.token_ids) == max_tokens
    return True


def test_the_registry_accepts_exactly_the_adapters_a_worker_holds(fleet) -> None:
    shared, registry, engine = fleet
    verdicts = {}
    with registry.client("publisher") as pub:
        for seed, (name, spec) in enumerate(ADAPTERS.items()):
            files = build_adapter(seed=seed, **spec)
            answer = publish(pub, f"cap-{name}", files, "v1")
            assert answer.status_code in (201, 422), (name, answer.text)
            accepted = answer.status_code == 201
            served = worker_serves_adapter(shared, engine, files.config, files.weights)
            verdicts[name] = (accepted, served)
            if name in LIMIT:  # a refusal past a limit names it
                assert answer.json()["limit"] == LIMIT[name], answer.text
    disagree = {n: v for n, v in verdicts.items() if v[0] != v[1]}
    assert not disagree, f"(registry accepted, worker served) differ: {disagree}"
    assert verdicts["rank-at-limit"] == (True, True)
    assert verdicts["rank-over-limit"] == (False, False)
    assert verdicts["float64"] == (False, False)
    assert verdicts["mixed-dtypes"] == (False, False)


def test_the_registry_accepts_exactly_the_gate_cases_a_worker_runs(
        fleet, served_model: ServedModel) -> None:
    shared, registry, engine = fleet
    verdicts = {}
    with registry.client("publisher") as pub:
        for seed, (name, (prompt, max_tokens)) in enumerate(CASES.items()):
            case = {"id": name, "max_tokens": max_tokens, "checks": [
                {"type": "regex", "pattern": "w"}],
                    **({"prompt": prompt} if isinstance(prompt, str)
                       else {"prompt_token_ids": prompt})}
            files = build_adapter(seed=100 + seed)
            answer = pub.post(f"/v1/adapters/ctx-{name}/versions", data={
                "org": "acme", "team": "search", "project": "prod", "owner": "o",
                "base_model": "tiny-llama", "label": "v1"}, files={
                "adapter_config": ("adapter_config.json", files.config),
                "adapter_model": ("adapter_model.safetensors", files.weights),
                "regression_set": ("set.jsonl", json.dumps(case).encode())})
            assert answer.status_code in (201, 422), (name, answer.text)
            if answer.status_code == 422:
                assert "context of 64 tokens" in answer.json()["detail"], answer.text
            verdicts[name] = (answer.status_code == 201,
                              worker_runs_case(shared, engine, served_model.path, prompt,
                                               max_tokens))
    disagree = {n: v for n, v in verdicts.items() if v[0] != v[1]}
    assert not disagree, f"(registry accepted, worker ran) differ: {disagree}"
    assert verdicts["fills-context"] == (True, True)
    assert verdicts["one-over"] == (False, False)
