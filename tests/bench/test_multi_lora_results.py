"""A run of some sections of the engine bench keeps the figures of the others; repeated
runs are summarised by their median run."""

from __future__ import annotations

import json
from pathlib import Path

from bench.multi_lora import EngineRun, kept_results, median_run


def test_a_partial_run_keeps_the_other_sections_and_records_its_own_settings(
        tmp_path: Path) -> None:
    out = tmp_path / "multi_lora.json"
    full = {"settings": {"requests": 16}, "run": {"command": "python bench/multi_lora.py"},
            "figures": [{"name": "old"}],
            "random_llama": {"mixed": {"x": 1}, "tenant_prefix": {"y": 2}}}
    out.write_text(json.dumps(full))
    now = {"requests": 64}
    kept = kept_results(out, now, "python bench/multi_lora.py --sections mixed")
    assert kept["settings"] == {"requests": 16}  # the kept sections' settings stay true
    assert kept["random_llama"]["tenant_prefix"] == {"y": 2}
    assert kept["full_run"]["command"] == "python bench/multi_lora.py"
    assert "run" not in kept and "figures" not in kept
    assert kept["partial_runs"] == [{"command": "python bench/multi_lora.py --sections mixed",
                                     "settings": now}]
    assert kept_results(out.with_name("missing.json"), now, "c") == {"settings": now}
    out.write_text("{not json")
    assert kept_results(out, now, "c") == {"settings": now}


def test_the_median_run_is_the_middle_one_and_the_lower_middle_of_an_even_count() -> None:
    runs = [EngineRun([[i]], seconds, 1.0) for i, seconds in enumerate((9.0, 7.0, 8.0))]
    assert median_run(runs).tokens == [[2]]
    assert median_run(runs[:2]).tokens == [[1]]
    assert median_run(runs[:1]).tokens == [[0]]


def test_interleaved_runs_give_each_engine_its_own_steps_tokens_and_dense_times(
        tmp_path: Path) -> None:
    """Stepping three engines in turn changes nothing they compute: each kind gets the
    tokens a run alone gives, its own step times (which sum to its seconds) and one dense
    time per forward step."""
    from bench import multi_lora as ml
    from services.worker.engine import ModelConfig

    ml.build_random_base(tmp_path / "base", seed=3, smoke=True)
    mc = ModelConfig.from_dir(tmp_path / "base")
    dirs = ml.write_adapters(tmp_path / "adapters", mc, 4, seed=3)
    workload = ml.mixed_workload(6, 4, mc.vocab_size, seed=3, scale=0.125)
    engines = ml.mixed_engines(tmp_path / "base", dirs, "float32")
    assert engines["engine_no_adapter"][1] == [None] * 4 and engines["engine_1"][2]
    yardstick = ml.DenseYardstick(engines["engine_32"][0].model)
    runs, dense = ml.run_interleaved(engines, workload, yardstick)
    alone, digests = ml.make_engine(tmp_path / "base", dirs, "float32")
    assert runs["engine_32"].tokens == ml.run_engine(alone, digests, workload).tokens
    assert runs["engine_1"].tokens != runs["engine_32"].tokens
    for kind, run in runs.items():
        assert [len(t) for t in run.tokens] == [r["max_tokens"] for r in workload]
        assert len(dense[kind]) == len(run.steps) > 0 and min(dense[kind]) > 0
        assert abs(sum(s[-1] for s in run.steps) - run.seconds) < 1e-6 * len(run.steps) + 1e-3
    roof = yardstick.roofline(runs["engine_32"].steps, dense["engine_32"])
    assert roof["all"]["steps"] == len(runs["engine_32"].steps)
    assert roof["all"]["fraction_of_dense"] > 0
    for eng, _, _ in engines.values():  # every engine's own forward is back
        assert "forward" not in vars(eng.model)


def test_the_yardstick_times_an_int8_model_through_its_own_kernel(tmp_path: Path) -> None:
    """An int8 base's ceiling is its int8 matmul's rate, over the same FLOPs as dense."""
    import torch

    from bench import multi_lora as ml
    from loraplane_kernels.int8 import Int8Weight, int8_linear
    from services.worker.engine.model import LlamaModel

    ml.build_random_base(tmp_path / "base", seed=3, smoke=True)
    model = LlamaModel.from_pretrained(tmp_path / "base", "bfloat16", weights="int8",
                                       int8_lm_head=True)
    int8 = ml.DenseYardstick(model)
    dense = ml.DenseYardstick(LlamaModel.from_pretrained(tmp_path / "base", "bfloat16"))
    assert int8.per_token == dense.per_token
    assert all(isinstance(w, Int8Weight) for w in [*int8.weights, int8.head])
    assert not any(isinstance(w, Int8Weight) for w in [*dense.weights, dense.head])
    x = torch.randn(3, int8.weights[0].shape[1], dtype=torch.bfloat16)
    assert torch.equal(ml.matmul(model, x, int8.weights[0]), int8_linear(x, int8.weights[0]))
    rows = torch.randn(40, x.shape[1], dtype=torch.bfloat16)  # past int8pack: dequantised
    assert torch.equal(ml.matmul(model, rows, int8.weights[0]),
                       int8_linear(rows, int8.weights[0]))
    assert "dequant" in model.workspace._buffers  # the engine's own reused buffer
    assert int8.seconds(5, 2) > 0 and dense.seconds(5, 2) > 0


def test_the_yardstick_as_served_times_the_engines_packed_weights(tmp_path: Path) -> None:
    """As served, the packed weights and LM head are what it multiplies, with oneDNN's
    linear; the roofline's own yardstick keeps plain F.linear."""
    import torch

    from bench import multi_lora as ml
    from services.worker.engine.model import ONEDNN, LlamaModel

    ml.build_random_base(tmp_path / "base", seed=3, smoke=True)
    model = LlamaModel.from_pretrained(tmp_path / "base", "bfloat16")
    model.pack_weights()
    served, plain = ml.DenseYardstick(model, as_served=True), ml.DenseYardstick(model)
    assert served.per_token == plain.per_token
    assert not any(w.is_mkldnn for w in [*plain.weights, plain.head])
    assert all(w.is_mkldnn for w in [*served.weights, served.head]) == ONEDNN
    x = torch.randn(4, served.weights[1].shape[1], dtype=torch.bfloat16)
    torch.testing.assert_close(ml.matmul(model, x, served.weights[1]),
                               ml.matmul(model, x, plain.weights[1]), rtol=2e-2, atol=2e-2)
    assert served.seconds(5, 2) > 0
