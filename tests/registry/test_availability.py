"""Honest answers when things go wrong: a broker that stops answering, a registry killed
with -9 under clients that retry. Each registry here runs on a broker of the test's own
or as a real process, so nothing here disturbs other tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from services.config import Settings
from services.stack.brokers import ApacheKafka
from services.stack.process import free_port
from tests.conftest import REPO, isolated_settings
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    TOKENS,
    RunningRegistry,
    domain_events,
    log_events,
    publish,
    register_base,
    registry_settings,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def registry_on(broker: ApacheKafka, tmp_path: Path, **overrides: float
                ) -> tuple[Settings, RunningRegistry, int]:
    """A started registry on the test's own one-partition broker, and the broker's pid
    (to pause it with SIGSTOP)."""
    settings = registry_settings(
        isolated_settings(broker.bootstrap, None, topic_partitions=1), tmp_path / "blobs",
        **overrides)
    running = RunningRegistry(settings).start()
    assert broker._child is not None
    return settings, running, broker._child.pid


def test_a_paused_broker_gets_503s_within_the_deadline_and_readyz_says_not_writable(
        own_broker: ApacheKafka, tmp_path: Path) -> None:
    _, running, pid = registry_on(own_broker, tmp_path,
                                  registry_write_timeout_s=2.0, lease_interval_s=0.5)
    try:
        with running.client() as admin:
            register_base(admin)
            assert publish(admin, "bot", build_adapter(), "v1").status_code == 201
            os.kill(pid, signal.SIGSTOP)
            try:
                def purge(_: int) -> tuple[int, float]:
                    with running.client() as client:
                        started = time.monotonic()
                        answer = client.post("/v1/tenants/acme/search/prod/purge", json={})
                        return answer.status_code, time.monotonic() - started

                with ThreadPoolExecutor(4) as pool:
                    answers = list(pool.map(purge, range(4)))
                assert [status for status, _ in answers] == [503] * 4, answers
                # the whole request is bounded, waiting behind the other writes included
                assert max(took for _, took in answers) < 2.0 + 1.0, answers
                ready = admin.get("/readyz")
                assert ready.status_code == 503, ready.json()
                assert ready.json()["reason"].startswith("not writable"), ready.json()
                assert admin.get("/v1/adapters/bot").status_code == 200  # reads go on
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: (r := admin.get("/readyz")).status_code == 200 or r.json(), 30,
                     interval_s=0.2, message="/readyz 200 again")
            done = admin.post("/v1/tenants/acme/search/prod/purge", json={})
            assert done.status_code == 202, done.text
    finally:
        running.stop()


def test_readyz_stops_claiming_writes_within_two_lease_intervals_of_a_broker_pause(
        own_broker: ApacheKafka, tmp_path: Path) -> None:
    """A paused broker under writes: every write hangs until its deadline, setting no
    error before then. /readyz must not answer 200 for longer than two lease intervals
    (plus a probe's slack) after writes stop committing, however long the writes wait."""
    interval = 0.5
    _, running, pid = registry_on(own_broker, tmp_path,
                                  registry_write_timeout_s=8.0, lease_interval_s=interval)
    stop = threading.Event()
    probes: list[tuple[float, int]] = []
    try:
        with running.client() as admin:
            register_base(admin)

            written: list[int] = []

            def write() -> None:  # keeps the command lock busy with hanging writes
                with running.client() as client:
                    while not stop.is_set():
                        written.append(
                            client.post("/v1/tenants/acme/search/prod/purge", json={}).status_code)

            writers = [threading.Thread(target=write) for _ in range(2)]
            for writer in writers:
                writer.start()
            wait_for(lambda: len(written) >= 4, 30, message="writes flowing before the pause")
            paused_at = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            try:
                while time.monotonic() < paused_at + 7.0:
                    probes.append((time.monotonic() - paused_at,
                                   admin.get("/readyz").status_code))
                    time.sleep(0.1)
            finally:
                os.kill(pid, signal.SIGCONT)
                stop.set()
            for writer in writers:
                writer.join(30)
            wait_for(lambda: (r := admin.get("/readyz")).status_code == 200 or r.json(), 30,
                     interval_s=0.2, message="/readyz 200 again")  # and says so again after
    finally:
        stop.set()
        running.stop()
    bound = 2 * interval + 0.5
    lies = [(round(at, 2), status) for at, status in probes if at > bound and status == 200]
    assert len(probes) > 20
    assert not lies, f"/readyz said 200 after writes stopped committing: {lies}"


def test_a_write_that_commits_after_an_outage_is_answered_after_a_fresh_lease(
        own_broker: ApacheKafka, tmp_path: Path) -> None:
    """Workers refuse to serve once the newest lease is older than their wall, so a write
    answered while the newest lease is stale tells a client the registry works while
    every worker is about to refuse. During a broker pause a lease renewal fails; a purge
    sent right then commits once the broker is back, while the lease thread waits for its
    next turn. Its 202 must still come after a lease committed after the pause."""
    interval = 2.0
    settings, running, pid = registry_on(own_broker, tmp_path,
                                         registry_write_timeout_s=3.0, lease_interval_s=interval)
    failed = 'loraplane_registry_commands_total{command="lease",outcome="unavailable"} 1.0'
    try:
        with running.client() as admin:
            register_base(admin)
            answered: list[tuple[int, datetime]] = []

            def purge() -> None:
                with running.client() as client:
                    status = client.post("/v1/tenants/acme/search/prod/purge",
                                         json={}).status_code
                    answered.append((status, datetime.now(UTC)))

            os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(lambda: failed in admin.get("/metrics").text, 30, interval_s=0.02,
                         message="a lease renewal failed in the pause")
                writer = threading.Thread(target=purge)
                writer.start()
                time.sleep(0.2)
            finally:
                os.kill(pid, signal.SIGCONT)
            writer.join(30)
    finally:
        running.stop()
    [(status, at)] = answered
    assert status == 202
    leases = [e.occurred_at for e in log_events(settings, settings.liveness_topic)
              if e.type == "RegistryLease" and e.occurred_at <= at]
    assert (at - max(leases)).total_seconds() < interval, (at, leases[-3:])


# --- kill -9 under retrying clients ----------------------------------------------------------


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    for name, value in settings.model_dump(mode="json", exclude_none=True).items():
        env[f"LORAPLANE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    env["LORAPLANE_LOG_LEVEL"] = "WARNING"
    return env


class RegistryProcess:
    """`loraplane serve registry` as a real process, to be killed with -9."""

    def __init__(self, settings: Settings, log: Path) -> None:
        self.settings = settings
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "serve", "registry"], cwd=REPO,
                env=_env(self.settings), stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def retried(call: Callable[[], httpx.Response], seen: list[int]) -> httpx.Response:
    """What a careful client does: retry on 503 and on a lost connection, same request."""
    def answered() -> httpx.Response | None:
        try:
            answer = call()
        except httpx.TransportError:
            seen.append(0)
            return None
        seen.append(answer.status_code)
        return answer if answer.status_code != 503 else None

    return wait_for(answered, 90,
                    message=lambda: f"an answer other than 503; statuses seen {seen[-20:]}")


def test_kill_9_while_clients_retry_every_committed_write_is_answered_as_committed(
        settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    reg = registry_settings(settings, tmp_path / "blobs", registry_port=port,
                            registry_write_timeout_s=5.0, lease_interval_s=1.0)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKENS['publisher'][0]}"}
    process = RegistryProcess(reg, tmp_path / "registry.log")
    process.start()
    clients, min_steps = 4, 3
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKENS['admin'][0]}"},
                      timeout=30) as admin:
        retried(lambda: admin.get("/readyz"), [])
        register_base(admin)
    answers: dict[str, httpx.Response] = {}
    statuses: list[int] = []
    kills_done = threading.Event()

    def client(c: int) -> None:
        # Writes keep flowing until every kill has landed, so each kill hits writes in
        # flight however fast the machine is.
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            s = 0
            while s < min_steps or not kills_done.is_set():
                key = f"c{c}-s{s}-{uuid.uuid4().hex[:6]}"
                blob = build_adapter(seed=1000 * c + s)
                answers[f"{key}-publish"] = retried(lambda s=s, key=key, blob=blob: publish(
                    http, f"client-{c}", blob, f"v{s + 1}",
                    headers={"Idempotency-Key": f"{key}-publish"}), statuses)
                answers[f"{key}-switch"] = retried(lambda s=s, key=key: http.put(
                    f"/v1/adapters/client-{c}/active", json={"version": s + 1},
                    headers={"Idempotency-Key": f"{key}-switch"}), statuses)
                s += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(3):  # three rounds: kill -9 while writes are in flight, restart
            answered = len(statuses)  # writes are flowing against this incarnation
            wait_for(lambda answered=answered: len(statuses) >= answered + 4, 60,
                     message="four more answers from this incarnation")
            process.kill()
            process.start()
        kills_done.set()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        kills_done.set()
        process.stop()
    wrong = {key: (a.status_code, a.text[:200]) for key, a in answers.items()
             if a.status_code not in (200, 201)}
    assert not wrong, wrong  # never a 4xx for a write that was (or then was) committed
    assert len(answers) >= clients * min_steps * 2
    assert statuses.count(503) + statuses.count(0) > 0  # the kills were felt
    events = domain_events(reg)
    keyed = [e.payload.idempotency_key for e in events if e.payload.idempotency_key]
    assert sorted(keyed) == sorted(answers)  # each write committed exactly once
    for key, answer in answers.items():
        event = next(e for e in events if e.payload.idempotency_key == key)
        assert answer.json()["event"]["event_id"] == str(event.event_id), key
