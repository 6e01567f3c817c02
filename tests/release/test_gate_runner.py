"""A gate run through the real engine: base, previous and new outputs, every check judged."""

from __future__ import annotations

import hashlib
import json

from services.catalog.gates import result_failures
from services.catalog.regression import parse_regression_set
from services.catalog.state import CatalogState
from services.contracts.events import GateRequest, QualityGateCompleted
from services.worker.engine import AdapterFiles, Engine
from services.worker.gate_runner import GateDuty, GateJob, GateRun, run_gate
from services.worker.pool.blobs import BlobMissing
from tests.release.model import PROMPT, NumberModel, first_tokens


def label_set(engine: Engine, numbers: NumberModel) -> bytes:
    """A set the `good` adapter passes and the `bad` one breaks (its label is not allowed)."""
    good = first_tokens(engine, numbers.adapters["good"])[0]
    bad = first_tokens(engine, numbers.adapters["bad"])[0]
    assert good != bad
    longer = engine.tokenizer.decode(first_tokens(engine, numbers.adapters["good"],
                                                  prompt="5 5 5", max_tokens=4))
    cases = [
        {"id": "label", "prompt": PROMPT, "max_tokens": 1, "checks": [
            {"type": "json_schema", "schema": {"type": "integer", "enum": [good, 1, 2]}}]},
        {"id": "shape", "prompt": "5 5 5", "max_tokens": 4, "checks": [
            {"type": "regex", "pattern": r"^\d+( \d+){3}$"},
            {"type": "max_divergence", "metric": "token_edit_distance", "max": 4}]},
        {"id": "golden", "prompt": "5 5 5", "max_tokens": 4, "checks": [
            {"type": "exact", "expected": longer}]},
    ]
    return "\n".join(json.dumps(c) for c in cases).encode()


def job(numbers: NumberModel, data: bytes, new: str, previous: str | None = "v1") -> GateJob:
    return GateJob(gate_id="g1", worker_id="w1", adapter_id="bot", version=3,
                   baseline_version=1 if previous else None, tenant_key="acme/search/prod",
                   regression_set=parse_regression_set(data), new=numbers.adapters[new].digest(),
                   previous=numbers.adapters[previous].digest() if previous else None)


def files(numbers: NumberModel) -> dict[object, AdapterFiles]:
    return {f.digest(): f for f in numbers.adapters.values()}


def request_of(gate_job: GateJob) -> GateRequest:
    return GateRequest(gate_id=gate_job.gate_id, worker_id=gate_job.worker_id,
                       regression_set_sha256=gate_job.regression_set.sha256,
                       cases=len(gate_job.regression_set.cases),
                       baseline_version=gate_job.baseline_version, timeout_s=60)


def test_a_good_version_passes_with_three_outputs_per_case(engine: Engine,
                                                           numbers: NumberModel) -> None:
    gate_job = job(numbers, label_set(engine, numbers), "good")
    result = run_gate(engine, gate_job, files(numbers))
    assert result.passed and result.error is None, result
    assert result_failures(result, request_of(gate_job)) == []
    assert [c.case_id for c in result.cases] == ["label", "shape", "golden"]
    label = result.cases[0]
    assert [(o.role, o.version) for o in label.outputs] == [("base", None), ("previous", 1),
                                                            ("new", 3)]
    assert label.outputs[2].text == str(first_tokens(engine, numbers.adapters["good"])[0])
    assert label.outputs[0].text == str(first_tokens(engine, None)[0])
    assert all(len(o.tokens_sha256) == 64 and o.tokens == 1 for o in label.outputs)
    assert [c.verdict for c in result.cases[1].checks] == ["pass", "pass"]
    assert result.base_model_digest == engine.base_digest
    assert not engine.list_adapters()  # what the gate loaded, it unloaded


def test_a_version_that_breaks_the_json_schema_fails(engine: Engine,
                                                     numbers: NumberModel) -> None:
    gate_job = job(numbers, label_set(engine, numbers), "bad")
    result = run_gate(engine, gate_job, files(numbers))
    assert not result.passed
    label = result.cases[0]
    assert not label.passed
    assert label.checks[0].kind == "json_schema" and label.checks[0].verdict == "fail"
    assert "is not one of" in label.checks[0].detail
    failures = result_failures(result, request_of(gate_job))
    assert failures[0].startswith("case label (line 1): json_schema: schema violated")


def test_first_version_skips_divergence(engine: Engine, numbers: NumberModel) -> None:
    gate_job = job(numbers, label_set(engine, numbers), "good", previous=None)
    result = run_gate(engine, gate_job, files(numbers))
    assert result.passed
    assert [o.role for o in result.cases[1].outputs] == ["base", "new"]
    assert result.cases[1].checks[1].verdict == "skipped"


def test_files_that_do_not_match_the_digests_fail_the_gate(engine: Engine,
                                                          numbers: NumberModel) -> None:
    gate_job = job(numbers, label_set(engine, numbers), "good")
    tampered = files(numbers)
    real = numbers.adapters["good"]
    tampered[real.digest()] = AdapterFiles(real.config_json, real.weights[:-1] + b" ")
    result = run_gate(engine, gate_job, tampered)
    assert not result.passed
    assert result.error and "AdapterDigestMismatch" in result.error
    assert result_failures(result, request_of(gate_job))[0].startswith("run failed on w1")
    assert not engine.list_adapters()


def test_a_run_that_cannot_finish_is_a_failure_not_a_pass(numbers: NumberModel) -> None:
    gate_job = job(numbers, b'{"prompt": "1 2", "checks": [{"type": "regex", "pattern": "."}]}',
                   "good", previous=None)
    run = GateRun(gate_job, "ab" * 32)
    assert len(run.requests()) == 2
    result = run.failed("RequestError: text prompts need a tokenizer.json")
    assert not result.passed and result.cases == []


def duty_state(numbers: NumberModel, engine: Engine, data: bytes) -> CatalogState:
    """bot@1 published with a gate assigned to w1 (an adapter's first version)."""
    from services.catalog.regression import parse_regression_set as parse
    from services.contracts.events import AdapterVersionPublished, Envelope

    files = numbers.adapters["good"]
    request = GateRequest(gate_id="g1", regression_set_sha256=parse(data).sha256,
                          cases=len(parse(data).cases), worker_id="w1", timeout_s=60)
    published = AdapterVersionPublished(
        adapter_id="bot", version=1, label="v1", base_model="numbers",
        base_model_digest=engine.base_digest, sha256=files.digest().sha256,
        config_sha256=files.digest().config_sha256, size_bytes=1, rank=4, lora_alpha=8,
        target_modules=["q_proj"], dtype="float16", owner="o", gate_required=True,
        quality_gate=request)
    state = CatalogState()
    state.apply(Envelope.new(published, stream="adapter/bot", seq=1, actor="publisher:p"))
    return state


def test_a_worker_duty_runs_each_gate_once_and_retries_only_transient_failures(
        engine: Engine, numbers: NumberModel) -> None:
    data = label_set(engine, numbers)
    state = duty_state(numbers, engine, data)
    files = numbers.adapters["good"]
    blobs = {hashlib.sha256(data).hexdigest(): data, files.digest().sha256: files.weights,
             files.digest().config_sha256: files.config_json}
    emitted: list[QualityGateCompleted] = []
    away = {"now": True}

    def fetch(digest: str) -> bytes:
        if away["now"] and digest == files.digest().sha256:
            raise ConnectionError("registry unreachable")
        if digest not in blobs:
            raise BlobMissing(digest)
        return blobs[digest]

    duty = GateDuty(engine, "w1", fetch, emitted.append)
    [due] = duty.due(state)
    assert duty.run(due) is None and not emitted  # transient: retried later
    away["now"] = False
    [due] = duty.due(state)
    result = duty.run(due)
    assert result is not None and result.passed and emitted == [result]
    assert duty.due(state) == []  # answered once
    # a set the registry no longer has fails the gate instead of hanging it
    missing = GateDuty(engine, "w1", lambda d: (_ for _ in ()).throw(BlobMissing(d)),
                       emitted.append)
    [due] = missing.due(state)
    failed = missing.run(due)
    assert failed is not None and not failed.passed
    assert failed.error and failed.error.startswith("regression set unavailable")
