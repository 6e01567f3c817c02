"""The quick set of fault scenarios, on one cluster (about 2 minutes on 2 cores): the
active registry partitioned from Kafka and a worker partitioned from Kafka past the
version wall. Each runs under load and must end with no anomaly in the checker's report;
the full set, the broker faults included, is `make chaos`."""

from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import ClusterRig
from tests.cluster.scenarios import QUICK, SCENARIOS, run_scenario, target_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", QUICK)
def test_scenario_has_no_anomaly(rig: ClusterRig, name: str) -> None:
    seed = 1000 + QUICK.index(name)
    result = run_scenario(rig.cluster, SCENARIOS[name], seed=seed, quick=True,
                          files=rig.files, target=target_of(rig.cluster, rig.inference_token),
                          out_dir=rig.out_dir)
    print(result["line"])
    (rig.out_dir / f"{name}.result.json").write_text(json.dumps(result, indent=1, default=str))
    counts = result["counts"]
    assert counts["generate"]["ok"] > 0 and counts["publish"]["ok"] > 0, result["line"]
    anomalies = result["check"]["anomalies"]
    assert not anomalies, "\n".join(f"{a['check']}: {a['detail']}" for a in anomalies)
    if name == "registry-kafka-partition":
        assert result["notes"]["takeover_s"] < 10.0, result["notes"]
        assert result["notes"]["no_ping_pong"], result["notes"]
    if name == "worker-kafka-partition":
        assert result["notes"]["recovered_s"] < 60.0, result["notes"]
