"""The canary controller's /metrics endpoint answers with its families (the release flow
tests check the values a real rollout leaves there)."""

from __future__ import annotations

import httpx

from services.release.metrics import CanaryMetrics


def test_the_metrics_endpoint_answers_on_any_free_port() -> None:
    metrics = CanaryMetrics()
    port = metrics.serve(0)
    try:
        metrics.judgements.labels("wait").inc()
        answer = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        metrics.close()
    assert answer.status_code == 200
    assert 'loraplane_canary_judgements_total{outcome="wait"} 1.0' in answer.text
    for family in ("loraplane_canary_last_judgement_timestamp_seconds",
                   "loraplane_canary_rollouts_running", "loraplane_canary_ready"):
        assert family in answer.text
