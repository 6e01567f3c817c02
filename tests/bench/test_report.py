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


def test_the_chaos_result_renders_one_row_per_scenario_and_every_anomaly(
        tmp_path: Path) -> None:
    run = BenchRun("chaos", quick=False, argv=[])
    counts = {"publish": {"attempted": 10, "ok": 8, "fail": 1, "unknown": 1},
              "switch": {"attempted": 8, "ok": 8, "fail": 0, "unknown": 0},
              "generate": {"attempted": 100, "ok": 97, "fail": 3, "unknown": 0}}
    scenario = {"scenario": "registry-kafka-partition", "seed": 3, "description": "cut",
                "counts": counts, "notes": {"takeover_s": 5.4}, "anomalies": 1,
                "latency": {"generate": {"p99_before_ms": 300.0, "p99_fault_ms": 410.0}},
                "check": {"anomalies": [{"check": "writes", "detail": "lost key k1"}]}}
    run.save(tmp_path / "chaos.json", {"scenarios": [scenario], "anomalies": 1,
                                       "startup": {"total": 46.3, "network": 0.9}},
             [Figure("registry-kafka-partition: anomalies", 1, "anomalies", target="0",
                     meets_target=False)], echo=False)

    report = render(tmp_path)

    row = next(line for line in report.splitlines()
               if line.startswith("| registry-kafka-partition | 3 |"))
    assert "| 18/16/1/1 |" in row and "| 100/97/3 |" in row
    assert "300.0 / 410.0 ms" in row and "| 5.4 s |" in row and row.endswith("| 1 |")
    assert "- registry-kafka-partition: writes: lost key k1" in report
    assert "Harness start-up: 46.30 s (network 0.9 s)" in report


def test_report_links_the_method_of_every_bench_it_lists() -> None:
    """The figures page says how they were measured: METHOD.md, linked from its head, names
    every bench `make bench` runs."""
    repo = Path(__file__).resolve().parents[2]
    report = render(repo / "bench" / "results")
    assert "[METHOD.md](METHOD.md)" in report.split("\n\n")[1]
    method = (repo / "bench" / "METHOD.md").read_text()
    make = (repo / "Makefile").read_text()
    benches = next(line for line in make.splitlines() if line.startswith("BENCHES"))
    for name in benches.split(":=")[1].split():
        assert f"`python bench/{name}.py" in method, name
