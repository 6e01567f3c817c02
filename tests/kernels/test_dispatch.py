"""Backend choice and the tuning-table decisions behind ``lora_apply``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraplane_kernels import dispatch, tuning_table
from loraplane_kernels.tuning_table import (
    TUNING_DIR,
    TuningFallbackWarning,
    load_table,
    parse_table,
    read_table,
    table_file_name,
)

TABLE = {
    "device": "Test GPU",
    "source": "hand-written for the test",
    "entries": {
        "bgmv": {
            "4096": {"16": {"fused_max_tokens": 48, "shrink_split_k": 4},
                     "64": {"fused_max_tokens": 8, "fused_n_split": 2}},
            "8192": {"16": {"fused_max_tokens": 24}},
        },
        "sgmv": {"4096": {"128": {"fused_max_tokens": 0}}},
    },
}


@pytest.fixture
def table(tmp_path: Path) -> tuning_table.TuningTable:
    path = tmp_path / "Test_GPU.json"
    path.write_text(json.dumps(TABLE))
    return read_table(path)


@pytest.mark.parametrize(
    ("tokens", "hidden", "max_rank", "fused", "split_k"),
    [
        (48, 4096, 16, True, 4),    # at the threshold: fused
        (49, 4096, 16, False, 4),   # past it: separate
        (8, 4096, 33, True, 1),     # rank 33 falls in the 64 bucket
        (9, 4096, 64, False, 1),
        (9, 4096, 128, False, 1),   # past the largest bucket: the largest is used
        (24, 7168, 16, True, 1),    # 7168 is nearer 8192 than 4096 (log scale)
        (24, 5000, 16, True, 4),    # 5000 is nearer 4096
    ],
)
def test_plan_uses_the_matching_table_entry(table, tokens, hidden, max_rank, fused,
                                            split_k) -> None:
    plan = dispatch.plan_apply(tokens, hidden, max_rank, segmented=False, table=table)
    assert (plan.op, plan.fused, plan.entry.shrink_split_k) == ("bgmv", fused, split_k)


def test_plan_explicit_choice_overrides_table(table) -> None:
    assert not dispatch.plan_apply(1, 4096, 16, segmented=False, table=table, fused=False).fused
    plan = dispatch.plan_apply(1, 4096, 16, segmented=True, table=table)
    assert (plan.op, plan.fused) == ("sgmv", False)


def test_device_name_maps_to_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert table_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert table_file_name("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100_SXM4_80GB.json"
    path = tmp_path / "override.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setenv(tuning_table.OVERRIDE_ENV, str(path))
    loaded = load_table("Some Unknown GPU")
    assert loaded.device == "Test GPU" and not loaded.is_fallback


def test_unknown_gpu_falls_back_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tuning_table.OVERRIDE_ENV, raising=False)
    tuning_table._load_table.cache_clear()
    with pytest.warns(TuningFallbackWarning, match="Imaginary_GPU_9000.json"):
        fallback = load_table("Imaginary GPU 9000")
    assert fallback.is_fallback and fallback.path.name == "default.json"
    assert "not measured" in fallback.source


def test_shipped_tables_are_well_formed() -> None:
    files = sorted(TUNING_DIR.glob("*.json"))
    assert any(f.name == "default.json" for f in files)
    for f in files:
        table = read_table(f)
        assert set(table.entries) == set(tuning_table.OPS), f.name


def test_malformed_table_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="malformed"):
        parse_table({"device": "x", "source": "y", "entries": {"bgmv": {"4096": {"16": {
            "fused_max_token": 3}}}}}, tmp_path / "bad.json", is_fallback=False)


def test_cpu_tensors_use_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    assert dispatch.select_backend(torch.device("cpu")) == "torch"
    assert dispatch.select_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")
    assert dispatch.select_backend(torch.device("cuda", 0)) == "torch"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=dispatch.BACKEND_ENV):
        dispatch.select_backend(torch.device("cpu"))


def test_forcing_triton_on_cpu_without_interpreter_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    if dispatch.triton_interpreted():  # a session started with TRITON_INTERPRET=1
        assert dispatch.select_backend(torch.device("cpu")) == "triton"
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            dispatch.select_backend(torch.device("cpu"))


def test_fusion_threshold_is_measured_or_absent(table, monkeypatch) -> None:
    """Two-level batching: only a measured table fuses base + LoRA; an untuned GPU model
    (the fallback table, or a table without the field) takes the separate path, warns
    once, and sets the untuned gauge."""
    monkeypatch.setattr(dispatch, "_WARNED", set())
    measured = parse_table({**TABLE, "entries": {**TABLE["entries"], "sgmv": {"4096": {"16": {
        "fused_max_tokens": 0, "fused_base_max_tokens": 12}}}}}, table.path, is_fallback=False)
    assert dispatch.fusion_threshold(measured, "Test GPU", 4096, 16) == 12
    assert dispatch.UNTUNED.labels(device="Test GPU")._value.get() == 0
    with pytest.warns(TuningFallbackWarning, match="separate path"):
        assert dispatch.fusion_threshold(table, "Other GPU", 4096, 64) is None
    assert dispatch.UNTUNED.labels(device="Other GPU")._value.get() == 1
    fallback = read_table(TUNING_DIR / "default.json", is_fallback=True)
    assert dispatch.fusion_threshold(fallback, "Other GPU", 4096, 16) is None
    assert all(e.fused_max_tokens == 0 for by_rank in fallback.entries.values()
               for entries in by_rank.values() for e in entries.values())


def test_cpu_never_fuses_base_and_lora(monkeypatch) -> None:
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    assert dispatch.base_fusion_threshold(torch.device("cpu"), 4096, 64) is None
