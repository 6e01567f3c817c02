"""The registry's clock for quality gates: a gate that cannot complete becomes FAILED.

Every `gate_sweep_interval_s` the sweeper looks for pending gates with no worker, past
their deadline, or whose worker stopped heartbeating (`services.catalog.release_rule.
overdue_gates`) and writes one `QualityGateExpired` for each through the ordinary command
path, so the expiry is an event like any other decision, with the registry as its actor.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

from services.catalog.release_rule import overdue_gates
from services.catalog.state import Refusal
from services.registry.node import RegistryNode, WritesUnavailable
from services.registry.release_commands import expire_gate

log = logging.getLogger("loraplane.registry.gates")


class GateSweeper:
    def __init__(self, node: RegistryNode) -> None:
        self.node = node
        self.interval_s = node.settings.gate_sweep_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gate-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.node.active.is_set():
                continue
            try:
                self.sweep(datetime.now(UTC))
            except Exception:  # the sweeper must outlive any one bad pass
                log.exception("gate sweep failed")

    def sweep(self, now: datetime) -> int:
        """Expire what is overdue now; returns how many gates it expired."""
        with self.node.state_lock:
            overdue = overdue_gates(self.node.state, now)
        expired = 0
        for item in overdue:
            try:
                self.node.execute("gate_expire", lambda s, item=item: expire_gate(s, item),
                                  actor=self.node.registry_id)
            except Refusal:
                continue  # a result arrived meanwhile
            except WritesUnavailable as exc:
                log.warning("cannot expire gate %s now: %s", item.gate_id, exc.message)
                return expired
            expired += 1
            log.warning("quality gate %s of %s@%d expired (%s): %s", item.gate_id,
                        item.adapter_id, item.version, item.cause, item.reason)
        return expired
