"""Upload validation without a server: header parsing, naming, shapes, NaN/Inf, tarballs."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch

from services.contracts.capacity import AdapterLimits
from services.registry.validation import UploadRejected, unpack_archive, validate_adapter
from tests.registry.artifacts import (
    LLAMA_CONFIG,
    AdapterFiles,
    adapter_tarball,
    build_adapter,
    tarball,
    tensor_name,
)

ALLOWED = ["float16", "bfloat16", "float32"]


def check(files: AdapterFiles, sink: io.BytesIO | None = None, **config_overrides: object):
    return validate_adapter(files.config, io.BytesIO(files.weights), len(files.weights),
                            {**LLAMA_CONFIG, **config_overrides},
                            limits=AdapterLimits(64, tuple(ALLOWED)), sink=sink)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_valid_adapter_facts_and_streamed_copy(dtype: torch.dtype) -> None:
    files = build_adapter(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"), dtype=dtype)
    sink = io.BytesIO()
    facts = check(files, sink)
    assert facts.sha256 == files.sha256 and sink.getvalue() == files.weights
    assert facts.config_sha256 == hashlib.sha256(files.config).hexdigest()
    assert facts.rank == 8 and facts.lora_alpha == 16.0 and facts.size_bytes == len(files.weights)
    assert facts.dtype == str(dtype).removeprefix("torch.")
    assert facts.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj")


def test_peft_made_adapter_passes() -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures", "model_type")}))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "down_proj"]))
    from safetensors.torch import save

    state = peft.get_peft_model_state_dict(lora)
    config = json.dumps(lora.peft_config["default"].to_dict(), default=list).encode()
    files = AdapterFiles(config, save({k: v.contiguous() for k, v in state.items()}))
    assert check(files).target_modules == ("q_proj", "down_proj")


def _rejected(files: AdapterFiles, **config_overrides: object) -> UploadRejected:
    with pytest.raises(UploadRejected) as caught:
        check(files, **config_overrides)
    return caught.value


def test_shape_mismatch_names_the_tensor() -> None:
    name = tensor_name(0, "q_proj", "B")
    err = _rejected(build_adapter(), head_dim=8)  # q is 4x8=32 wide, not 64
    assert err.tensor == tensor_name(0, "q_proj", "A") or err.tensor == name
    err = _rejected(build_adapter(edit=lambda t: t.__setitem__(name, torch.zeros(64, 3).half())))
    assert err.tensor == name and "expected [64, 4]" in err.message


def test_gqa_shapes_follow_kv_heads() -> None:
    assert check(build_adapter(targets=("k_proj",))).rank == 4
    assert _rejected(build_adapter(targets=("k_proj",)), num_key_value_heads=4).tensor


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_nan_and_inf_are_found_by_name(value: float, dtype: torch.dtype) -> None:
    name = tensor_name(1, "v_proj", "A")
    files = build_adapter(dtype=dtype, edit=lambda t: t[name].view(-1).__setitem__(-1, value))
    err = _rejected(files)
    assert err.tensor == name and "NaN or Inf" in err.message


def test_config_refusals() -> None:
    assert "maximum rank" in _rejected(build_adapter(rank=128)).message
    assert "use_dora" in _rejected(build_adapter(
        config_edit=lambda c: c.__setitem__("use_dora", True))).message
    assert "lm_head" in _rejected(build_adapter(
        config_edit=lambda c: c.__setitem__("target_modules", ["q_proj", "lm_head"]))).message
    err = _rejected(build_adapter(targets=("q_proj", "v_proj"),
                                  config_edit=lambda c: c.__setitem__("target_modules",
                                                                      ["q_proj"])))
    assert err.tensor == tensor_name(0, "v_proj", "A")
    err = _rejected(build_adapter(dtype=torch.float64))
    assert "float64" in err.message


def test_layer_out_of_range_and_missing_pair() -> None:
    err = _rejected(build_adapter(layers=3))
    assert err.tensor == tensor_name(2, "q_proj", "A")
    missing = tensor_name(1, "q_proj", "B")
    err = _rejected(build_adapter(edit=lambda t: t.pop(missing)))
    assert err.tensor == missing


@pytest.mark.parametrize("weights", [b"", b"\x01", (2**40).to_bytes(8, "little") + b"{}",
                                     (2).to_bytes(8, "little") + b"[]",
                                     (5).to_bytes(8, "little") + b"nope!"])
def test_garbage_safetensors(weights: bytes) -> None:
    _rejected(AdapterFiles(build_adapter().config, weights))


def test_trailing_or_overlapping_bytes() -> None:
    files = build_adapter()
    _rejected(AdapterFiles(files.config, files.weights + b"\0\0"))


def test_archive_members_and_hostile_archives() -> None:
    files = build_adapter()
    unpacked = unpack_archive(io.BytesIO(adapter_tarball(files)), 1 << 20)
    assert unpacked.config == files.config and unpacked.weights.read() == files.weights
    flat = unpack_archive(io.BytesIO(adapter_tarball(files, prefix="")), 1 << 20)
    assert flat.weights_size == len(files.weights)
    good = {"adapter_config.json": files.config, "adapter_model.safetensors": files.weights}
    for archive in (tarball({**good, "a/../../x": b""}), tarball({**good, "/abs": b""}),
                    tarball(good, links={"l": "/etc/passwd"}),
                    tarball(good, hardlinks={"h": "adapter_config.json"}),
                    tarball({"adapter_config.json": files.config}), b"not a tarball"):
        with pytest.raises(UploadRejected) as err:
            unpack_archive(io.BytesIO(archive), 1 << 20)
        assert err.value.status == 422
    with pytest.raises(UploadRejected) as big:
        unpack_archive(io.BytesIO(adapter_tarball(files)), 100)
    assert big.value.status == 413
