"""Engine support for the worker: tenant purge zeroes KV, refcount query, placing a parsed
adapter, and the base digest of a directory without loading it for serving."""

from __future__ import annotations

import torch

from services.worker.engine import (
    AdapterFiles,
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    checkpoint_digest,
    parse_adapter,
)


def engine(tiny) -> Engine:
    return Engine.from_pretrained(tiny.path, EngineConfig(num_kv_blocks=64, block_size=4,
                                                          adapter_slots=2, max_lora_rank=16))


def blocks_of(eng: Engine, tenant: str) -> set[int]:
    return {b for b, info in enumerate(eng.blocks.blocks)
            if info.scope is not None and info.scope.tenant_key == tenant}


def kv_rows(eng: Engine, blocks: set[int]) -> torch.Tensor:
    slots = torch.tensor([b * 4 + i for b in sorted(blocks) for i in range(4)])
    return torch.cat([eng.kv.k[:, :, slots].flatten(), eng.kv.v[:, :, slots].flatten()])


def test_purge_aborts_frees_and_zeroes_only_that_tenant(tiny) -> None:
    eng = engine(tiny)
    done = eng.generate([GenerationRequest(prompt_token_ids=list(range(3, 20)),
                                           sampling=SamplingParams(max_tokens=4),
                                           tenant_key="a/b/c", request_id="a-done"),
                         GenerationRequest(prompt_token_ids=list(range(3, 20)),
                                           sampling=SamplingParams(max_tokens=4),
                                           tenant_key="x/y/z", request_id="x-done")])
    assert all(r.finish_reason is FinishReason.LENGTH for r in done)
    eng.submit(GenerationRequest(prompt_token_ids=list(range(30, 45)),
                                 sampling=SamplingParams(max_tokens=50, ignore_eos=True),
                                 tenant_key="a/b/c", request_id="a-running"))
    eng.step()
    eng.step()
    cached = blocks_of(eng, "a/b/c")
    running = set(eng._seqs["a-running"].block_table)
    other = blocks_of(eng, "x/y/z")
    other_kv = kv_rows(eng, other).clone()
    assert cached and running and other and kv_rows(eng, cached | running).abs().sum() > 0
    assert eng.tenant_references("a/b/c") > 0
    result = eng.purge_tenant("a/b/c")
    assert result.sequences_aborted == 1 and result.aborted_request_ids == ["a-running"]
    assert result.blocks_freed == len(cached | running)
    assert eng.pop_result("a-running").finish_reason is FinishReason.ABORT  # type: ignore[union-attr]
    assert eng.tenant_references("a/b/c") == 0 and not blocks_of(eng, "a/b/c")
    assert kv_rows(eng, cached | running).abs().sum() == 0, "the tenant's K/V is zeroed"
    assert torch.equal(kv_rows(eng, other), other_kv), "other tenants keep theirs"
    assert blocks_of(eng, "x/y/z") == other


def test_place_a_parsed_adapter_like_load(tiny) -> None:
    eng = engine(tiny)
    path = next(iter(tiny.adapters.values()))
    files = AdapterFiles.from_dir(path)
    digest = files.digest()
    info = eng.adapters.place(parse_adapter(files, eng.model.cfg, digest), pin=True)
    assert info.digest == digest and info.pinned and eng.adapters.is_loaded(digest)
    loaded = engine(tiny)
    loaded.load_adapter(path, digest)
    request = dict(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=5),
                   adapter_digest=digest)
    assert eng.generate([GenerationRequest(**request)])[0].token_ids == \
        loaded.generate([GenerationRequest(**request)])[0].token_ids


def test_checkpoint_digest_is_the_engine_s_base_digest(tiny) -> None:
    assert checkpoint_digest(tiny.path) == engine(tiny).base_digest
