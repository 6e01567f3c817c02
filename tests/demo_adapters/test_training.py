"""Training on a tiny random Llama: the cached-prefix loss equals transformers' own, and
the lookup trains into the cache once, reuses it, and notices changed inputs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.demo_adapters.build import RECORD, demo_adapters, fingerprint, mismatch
from services.demo_adapters.tenants import DEMO_TENANTS
from services.demo_adapters.training import Example, TrainingPlan, frozen_states, reply_loss
from services.worker.engine import Engine, EngineConfig, checkpoint_digest
from tests.worker.engine.tiny_llama import build_model

CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5 {% endif %}")
TINY_PLAN = TrainingPlan(rank=4, alpha=8, target_modules=("q_proj", "v_proj"), first_layer=1,
                         steps=3, batch_size=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("tiny")
    model = build_model(path)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))
    return path, model


def test_reply_loss_from_cached_states_equals_transformers_loss(tiny: tuple[Path, object]
                                                                ) -> None:
    _, model = tiny
    examples = [Example([3, 7, 8, 4, 5, 10, 11, 12, 2], 5), Example([3, 9, 4, 5, 13, 2], 4)]
    width = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for j, e in enumerate(examples):
        ids[j, :len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[j, :len(e.input_ids)] = 1
        labels[j, e.prompt_len:len(e.input_ids)] = torch.tensor(e.input_ids[e.prompt_len:])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # type: ignore[operator]
        states = frozen_states(model, examples, first_layer=1)
        got = reply_loss(model, 1, examples, states)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_demo_adapters_train_into_the_cache_once_and_load_in_the_engine(
        tiny: tuple[Path, object], tmp_path: Path) -> None:
    path, _ = tiny
    digest = checkpoint_digest(path)
    spec = replace(DEMO_TENANTS[2], adapter_id="tiny-json", plan=TINY_PLAN)
    trained: list[str] = []

    def lookup(**kw: object) -> Path:
        [found] = demo_adapters(path, tmp_path, base_digest=digest, tenants=[spec],
                                on_train=lambda s, _: trained.append(s.adapter_id), **kw)
        assert not found.committed and found.tenant == spec.tenant
        return found.directory

    first = lookup()
    assert trained == ["tiny-json"] and mismatch(spec, first, digest) is None
    config = json.loads((first / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1] and config["r"] == 4
    assert str(path) not in (first / "adapter_config.json").read_text()
    record = json.loads((first / RECORD).read_text())
    assert record["fingerprint"] == fingerprint(spec, digest)
    assert record["training"]["final_loss"] is not None

    assert lookup() == first and trained == ["tiny-json"]  # cached: nothing re-trained
    assert lookup(retrain=True) == first and trained == ["tiny-json"] * 2

    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=8, adapter_slots=1))
    assert engine.load_adapter(first).rank == 4


def test_mismatch_names_what_changed(tiny: tuple[Path, object], tmp_path: Path) -> None:
    path, _ = tiny
    digest = checkpoint_digest(path)
    spec = replace(DEMO_TENANTS[0], adapter_id="tiny-support", plan=TINY_PLAN)
    assert mismatch(spec, tmp_path / "nothing", digest) == "not trained"
    [found] = demo_adapters(path, tmp_path, base_digest=digest, tenants=[spec])
    assert mismatch(spec, found.directory, "0" * 64) == (
        "trained from other inputs: base_model_digest")
    other_plan = replace(spec, plan=replace(TINY_PLAN, steps=4))
    assert mismatch(other_plan, found.directory, digest) == "trained from other inputs: plan"
    weights = found.directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    assert "adapter_model.safetensors does not match" in str(
        mismatch(spec, found.directory, digest))
