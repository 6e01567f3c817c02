"""An idle registry leaves the CPU to others: no background thread of an active instance
spins. (The erasure resumer once re-checked an event that stays set while the instance
is active, in a loop with no pause: a core at 100 %, and each request 30x slower for the
GIL.)"""

from __future__ import annotations

import time

import pytest

from tests.registry.conftest import RunningRegistry

pytestmark = pytest.mark.slow


def test_an_idle_active_registry_uses_little_cpu(
        registry: RunningRegistry) -> None:
    assert registry.node.active.is_set()
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(2.0)  # idle on purpose: what the instance's own threads spend
    share = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert share < 0.25, f"an idle registry used {share:.0%} of a core"
