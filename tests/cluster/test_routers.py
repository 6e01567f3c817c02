"""Routers are interchangeable: both fold the same liveness topic into the same ring, so
any router serves any request and puts a tenant on the same worker; a client given both
addresses goes on through the other when one is killed."""

from __future__ import annotations

import time

import pytest

from services.client import InferenceClient
from services.cluster.topology import ROUTER_PORT
from services.config import Settings
from tests.cluster.conftest import ClusterRig
from tests.cluster.history import History
from tests.cluster.load import AdapterPlan, Load, wait_served
from tests.cluster.scenarios import setup_adapters, target_of

pytestmark = pytest.mark.slow


def test_any_router_serves_any_request_and_a_client_fails_over(rig: ClusterRig) -> None:
    cluster = rig.cluster
    history = History()
    plan = AdapterPlan("rt-a0", "rt0/chaos/run")
    load = Load(target_of(cluster, rig.inference_token), history, [plan], rig.files, seed=5)

    setup_adapters(load, [plan])
    wait_served(load, [plan])
    homes = set()
    for router in cluster.hosts("router-"):
        only = Settings(router_addresses=f"{router.address}:{ROUTER_PORT}")
        with InferenceClient(only, token=rig.inference_token, timeout_s=30) as client:
            for _ in range(3):
                done = client.complete(plan.tenant, adapter=plan.adapter_id, text="w1 w2",
                                       max_tokens=2, user="same-user")
                homes.add(done.final.worker_id)
    assert len(homes) == 1, f"the routers placed one tenant on {homes}"

    both = Settings(router_addresses=",".join(cluster.router_addresses))
    with InferenceClient(both, token=rig.inference_token, timeout_s=30,
                         connect_timeout_s=2.0) as client:
        first = client.complete(plan.tenant, adapter=plan.adapter_id, text="w1", max_tokens=2)
        assert first.final.worker_id
        cluster.kill("router-1")
        try:
            served = []
            started = time.monotonic()
            for _ in range(5):
                done = client.complete(plan.tenant, adapter=plan.adapter_id, text="w1 w2",
                                       max_tokens=2)
                served.append(done.final.trace_id)
            assert len(served) == 5
            assert client.address == cluster.router_addresses[1]
            assert time.monotonic() - started < 30
        finally:
            cluster.nodes["router-1"].start()
            cluster.wait_ready(["router-1"], timeout_s=120)
