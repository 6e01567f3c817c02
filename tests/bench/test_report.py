"""The benchmark report is rendered from the result files alone, with each figure's
baseline, ratio, settings, load average, command and machine."""

from __future__ import annotations

import json
from pathlib import Path

from bench.record import BenchRun, Figure
from bench.report import render


def test_report_renders_every_result_with_its_baseline_ratio_and_machine(tmp_path: Path) -> None:
    run = BenchRun("serve", quick=True, argv=["--quick"])
    run.save(tmp_path / "serve.json", {"engine_tok_s": 20.0}, [
        Figure("worker over gRPC, streamed tokens/s", 19.0, "tokens/s",
               baseline="the bare engine", baseline_value=20.0, target="ratio >= 0.90",
               meets_target=True, settings="12 requests", load_average=[1.5, 1.0, 0.5])],
        echo=False)
    (tmp_path / "replay.json").write_text(json.dumps({"rows": []}))  # an older result
    (tmp_path / "audit.json").write_text("{not json")

    report = render(tmp_path)

    row = next(line for line in report.splitlines() if line.startswith("| worker over gRPC"))
    assert "19.00 tokens/s" in row and "the bare engine" in row and "20.00 tokens/s" in row
    assert "0.95 (higher is better)" in row and "ratio >= 0.90: met" in row
    assert "1.50 / 1.00 / 0.50" in row and "12 requests" in row
    assert "`python bench/serve.py --quick` (quick mode" in report
    assert "- machine: " in report and "cores" in report
    assert "re-run `python bench/replay.py`" in report
    assert "unreadable" in report
    document = json.loads((tmp_path / "serve.json").read_text())
    assert document["figures"][0]["ratio"] == 0.95 and document["run"]["mode"] == "quick"


def test_the_recorded_command_keeps_the_environment_that_changes_cpu_timings(
        monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    run = BenchRun("multi_lora", quick=False, argv=["--clock", "cpu"])
    assert run.command == "OMP_WAIT_POLICY=PASSIVE python bench/multi_lora.py --clock cpu"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert BenchRun("serve", quick=True, argv=[]).command == "python bench/serve.py"
