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
