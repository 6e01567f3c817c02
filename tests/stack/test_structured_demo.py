"""Structured output on the packaged base model and every demo adapter: each answer to the
demo's question, asked with the initech tenant's JSON schema, parses and validates
(`jsonschema`), in one mixed batch with an unconstrained request beside them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.demo import QUESTION, STRUCTURED, chat_prompt
from services.demo_adapters import demo_adapters
from services.stack.models import ensure_smollm2
from services.worker.engine import (
    AdapterFiles,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from services.worker.engine.request import GuideSpec
from tests.conftest import CACHE

pytestmark = pytest.mark.slow


def test_every_demo_adapter_and_the_base_answer_in_schema() -> None:
    path = ensure_smollm2(CACHE)
    schema = STRUCTURED["initech-json"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=256, adapter_slots=4))
    digests = {a.adapter_id: engine.load_adapter(AdapterFiles.from_dir(a.directory)).digest
               for a in demo_adapters(path, CACHE)}
    prompt = chat_prompt(path, QUESTION)
    guide = GuideSpec("json_schema", json.dumps(schema))
    asked = [None, *digests.values()]
    requests = [GenerationRequest(prompt=prompt, adapter_digest=digest,
                                  sampling=SamplingParams(max_tokens=64, guide=guide))
                for digest in asked]
    requests.append(GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=8)))
    results = engine.generate(requests)
    for digest, result in zip(asked, results, strict=False):
        assert result.finish_reason.value == "stop", (digest, result.text)
        jsonschema.validate(json.loads(result.text), schema)
    assert engine.grammars.stats.compiled == 1
