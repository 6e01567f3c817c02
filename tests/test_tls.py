"""TLS and mutual TLS on real listeners, with certificates made here (`tests.certificates`):
the router's gRPC and HTTP fronts, a worker process (mutual TLS, the router dialling it
with its certificate), a registry process and the CLI, the projector's checkpoint
publication. On each: a client without the CA is refused, an expired certificate is
refused, a listener that requires client certificates refuses a client without one, and
certificate files replaced on disk are served from the next connection, no restart.
Kafka's SSL/SASL and PostgreSQL's sslmode settings reach their clients."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services import tls
from services.audit.publication import CheckpointFolder, HttpEndpoint, http_app
from services.config import Settings
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.eventlog.client import consumer_config, producer_config, security_config
from services.stack.process import free_port
from tests.certificates import Authority, Pem
from tests.conftest import REPO, isolated_settings
from tests.waiting import wait_for
from tests.worker.conftest import served_model

__all__ = ["served_model"]

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Certs:
    ca: Path
    server: Pem
    rotated: Pem
    expired: Pem
    client: Pem
    stranger: Pem
    """Signed by another CA."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    root = tmp_path_factory.mktemp("certs")
    ca = Authority(root / "ca")
    other = Authority(root / "other", "somebody else's CA")
    return Certs(ca.ca, ca.issue("server"), ca.issue("rotated"), ca.issue("expired",
                                                                          expired=True),
                 ca.issue("client", client=True), other.issue("stranger"))


def live_files(folder: Path, pem: Pem, name: str = "svc") -> tuple[Path, Path]:
    """Certificate and key files a listener is configured with, filled from `pem`."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    pem.install(cert, key)
    return cert, key


def rotate(pem: Pem, cert: Path, key: Path) -> None:
    pem.install(cert, key)
    later = time.time() + 2  # a new mtime even on a coarse clock
    os.utime(cert, (later, later))
    os.utime(key, (later, later))


def trust(ca: Path | None = None, client: Pem | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def peer_serial(port: int, ca: Path, client: Pem | None = None) -> int:
    """The serial number of the certificate a listener presents to a new connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            trust(ca, client).wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        der = sock.getpeercert(binary_form=True)
    from cryptography import x509

    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def grpc_health(address: str, ca: Path | None, client: Pem | None = None,
                plaintext: bool = False) -> int | str:
    """The health status over a new channel, or the gRPC code name of the failure."""
    if plaintext:
        channel = grpc.insecure_channel(address)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes() if ca else None,
            private_key=client.key.read_bytes() if client else None,
            certificate_chain=client.cert.read_bytes() if client else None)
        channel = grpc.secure_channel(address, credentials)
    with channel:
        try:
            return int(health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5).status)
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[attr-defined]


def https_refused(url: str, verify: ssl.SSLContext | bool) -> bool:
    try:
        httpx.get(url, verify=verify, timeout=5)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, ssl.SSLError):
        return True
    return False


# --- the router's two fronts -------------------------------------------------------------


def test_router_fronts_refuse_untrusted_and_expired_and_rotate_without_restart(
        kafka_bootstrap: str, certs: Certs, tmp_path: Path) -> None:
    from tests.router.conftest import RunningRouter, router_settings

    cert, key = live_files(tmp_path / "router", certs.expired)
    settings = router_settings(isolated_settings(kafka_bootstrap, None), tls_cert_file=cert,
                               tls_key_file=key, tls_ca_file=certs.ca)
    router = RunningRouter(settings).start()
    try:
        address = f"127.0.0.1:{router.app.grpc_port}"
        https = f"https://127.0.0.1:{router.app.http_port}/healthz"
        # an expired certificate: clients that trust its CA still refuse it, on both fronts
        assert grpc_health(address, certs.ca) == "UNAVAILABLE"
        assert https_refused(https, trust(certs.ca))

        rotate(certs.server, cert, key)  # the operator renews it; nothing restarts
        assert grpc_health(address, certs.ca) == health_pb2.HealthCheckResponse.SERVING
        assert httpx.get(https, verify=trust(certs.ca), timeout=5).json() == {"status": "ok"}
        assert peer_serial(router.app.http_port, certs.ca) == certs.server.serial
        assert peer_serial(router.app.grpc_port, certs.ca) == certs.server.serial

        rotate(certs.rotated, cert, key)  # and again: the next connection has the new one
        assert peer_serial(router.app.http_port, certs.ca) == certs.rotated.serial
        assert peer_serial(router.app.grpc_port, certs.ca) == certs.rotated.serial

        # a client without the CA (the system's trust only), and a plaintext client
        assert grpc_health(address, None) == "UNAVAILABLE"
        assert https_refused(https, True)
        assert grpc_health(address, None, plaintext=True) == "UNAVAILABLE"
        assert https_refused(https.replace("https", "http"), True)
        # a certificate of another CA put in place is refused by clients of ours
        rotate(certs.stranger, cert, key)
        assert grpc_health(address, certs.ca) == "UNAVAILABLE"
        assert https_refused(https, trust(certs.ca))
    finally:
        router.stop()


# --- a worker that requires client certificates, behind a router ---------------------------


@pytest.fixture(scope="module")
def worker_stack(kafka_bootstrap: str, served_model: object, certs: Certs,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.registry.conftest import TENANT
    from tests.worker.harness import Stack, fresh_adapter, publish_files, switch

    root = tmp_path_factory.mktemp("tls-worker")
    settings = isolated_settings(kafka_bootstrap, None)
    stack = Stack(settings, root, served_model.path)  # type: ignore[attr-defined]
    try:
        stack.register_base()
        cert, key = live_files(root / "worker-certs", certs.server, "worker")
        worker = stack.worker("wtls", tls_cert_file=cert, tls_key_file=key,
                              tls_ca_file=certs.ca, tls_client_auth='["worker"]').start()

        def serving() -> bool:
            assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
            return grpc_health(worker.address, certs.ca, certs.client) == 1

        wait_for(serving, 120, interval_s=0.3, message=lambda: f"mTLS health:\n{worker.log_tail()}")
        stack.wait_live("wtls")
        with stack.publisher() as pub:
            publish_files(pub, "tls-bot", fresh_adapter(6101), "v1", TENANT, qos_tier="gold")
            switch(pub, "tls-bot", 1)
        yield stack
    finally:
        stack.close()


def test_a_worker_requiring_client_certificates_serves_the_router_that_has_one(
        worker_stack: object, certs: Certs, tmp_path: Path) -> None:
    from tests.registry.conftest import TENANT
    from tests.router.conftest import RunningRouter, bearer, router_settings

    stack = worker_stack
    worker = stack.workers["wtls"]  # type: ignore[attr-defined]
    # mutual TLS: the CA alone is not enough, nor a client certificate of another CA
    assert grpc_health(worker.address, certs.ca) == "UNAVAILABLE"
    assert grpc_health(worker.address, certs.ca, certs.stranger) == "UNAVAILABLE"
    assert grpc_health(worker.address, certs.ca, certs.client) == 1
    assert "Traceback" not in worker.log_tail(200)

    cert, key = live_files(tmp_path / "router", certs.server, "router")
    settings = router_settings(stack.settings, heartbeat_interval_s=0.5,  # type: ignore[attr-defined]
                               tls_cert_file=cert, tls_key_file=key, tls_ca_file=certs.ca)
    router = RunningRouter(settings).start()
    try:
        router.wait_ring({"wtls"}, timeout_s=30)
        credentials = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{router.app.grpc_port}", credentials) as channel:
            request = pb.GenerateRequest(
                tenant=pb.TenantSignature(org_id=TENANT["org"], team_id=TENANT["team"],
                                          project_id=TENANT["project"], user_id="u"),
                adapter=pb.AdapterRef(alias="tls-bot"),
                sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
            request.token_ids.ids.extend([5, 6, 7])
            answers = list(pb_grpc.InferenceStub(channel).Generate(
                request, metadata=bearer("acme"), timeout=60))
        final = answers[-1].final
        assert (final.worker_id, final.completion_tokens) == ("wtls", 4)
        assert final.served_adapter.adapter_id == "tls-bot"
    finally:
        router.stop()


# --- the registry and the CLI ------------------------------------------------------------------


def test_registry_over_mutual_tls_answers_the_cli_with_a_certificate_only(
        kafka_bootstrap: str, certs: Certs, tmp_path: Path) -> None:
    from tests.registry.conftest import TOKENS, auth_setting

    settings = isolated_settings(kafka_bootstrap, None, state_dir=tmp_path / "state")
    cert, key = live_files(tmp_path / "registry", certs.server, "registry")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    values: dict[str, object] = {
        "kafka_bootstrap": settings.kafka_bootstrap, "topic_partitions": 3,
        "adapter_events_topic": settings.adapter_events_topic,
        "worker_events_topic": settings.worker_events_topic,
        "liveness_topic": settings.liveness_topic,
        "dead_letter_topic": settings.dead_letter_topic, "state_dir": tmp_path / "state",
        "auth_tokens": auth_setting(), "registry_port": port, "log_level": "WARNING",
        "tls_cert_file": cert, "tls_key_file": key, "tls_ca_file": certs.ca,
        "tls_client_auth": '["registry"]'}
    env.update({f"LORAPLANE_{k.upper()}": str(v) for k, v in values.items()})
    log = tmp_path / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "registry"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return httpx.get(f"{url}/readyz", verify=trust(certs.ca, certs.client),
                             timeout=2).status_code == 200

        wait_for(ready, 90, interval_s=0.3, ignoring=(httpx.HTTPError,),
                 message=lambda: f"/readyz over mTLS:\n{log.read_text()}")
        # the CA alone (no client certificate), and no CA: refused
        assert https_refused(f"{url}/readyz", trust(certs.ca))
        assert https_refused(f"{url}/readyz", trust(None, certs.client))

        def cli(*args: str, client: Pem | None) -> subprocess.CompletedProcess[str]:
            values = {"LORAPLANE_REGISTRY_URL": url, "LORAPLANE_TLS_CA_FILE": str(certs.ca),
                      "LORAPLANE_API_TOKEN": TOKENS["admin"][0],
                      "LORAPLANE_STATE_DIR": str(tmp_path / "cli")}
            if client is not None:
                values |= {"LORAPLANE_TLS_CERT_FILE": str(client.cert),
                           "LORAPLANE_TLS_KEY_FILE": str(client.key)}
            return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO,
                                  capture_output=True, text=True, timeout=60,
                                  env={"PATH": "/usr/bin:/bin", **values})

        answer = cli("base-models", "--json", client=certs.client)
        assert answer.returncode == 0 and answer.stdout == "", answer
        answer = cli("health", "registry", client=certs.client)
        assert answer.returncode == 0 and answer.stdout.strip() == "registry ready", answer
        answer = cli("base-models", "--json", client=None)
        assert answer.returncode == 1 and answer.stdout == "", answer
        assert answer.stderr.startswith("error: registry at https://") and \
            len(answer.stderr.strip().splitlines()) == 1, answer.stderr
        # rotated on disk: the next connection gets the new certificate
        rotate(certs.rotated, cert, key)
        assert peer_serial(port, certs.ca, certs.client) == certs.rotated.serial
        assert cli("base-models", "--json", client=certs.client).returncode == 0
    finally:
        proc.terminate()
        proc.wait(30)


# --- the projector's checkpoint publication --------------------------------------------------


def test_checkpoint_publication_over_mutual_tls_with_rotation(certs: Certs,
                                                              tmp_path: Path) -> None:
    folder = CheckpointFolder(tmp_path / "checkpoints")
    signature = "A" * 88
    note = (f"loraplane.local/audit/t/0\n1\n{'A' * 43}=\n\n"
            f"\u2014 loraplane.local/audit/t/0 {signature}\n")
    folder.publish("t", 0, 1, note)
    cert, key = live_files(tmp_path / "audit", certs.expired, "audit")
    settings = Settings(tls_cert_file=cert, tls_key_file=key, tls_ca_file=certs.ca,
                        tls_client_auth=["audit"])
    endpoint = HttpEndpoint("127.0.0.1", 0, http_app(folder, CollectorRegistry()),
                            tls.server_ssl_context(settings, "audit"))
    try:
        url = f"https://127.0.0.1:{endpoint.port}/checkpoints/t/0/latest"
        assert https_refused(url, trust(certs.ca, certs.client))  # expired
        rotate(certs.server, cert, key)
        answer = httpx.get(url, verify=trust(certs.ca, certs.client), timeout=5)
        assert answer.status_code == 200 and answer.text == note
        assert https_refused(url, trust(certs.ca))  # no client certificate
        assert https_refused(url, trust(None, certs.client))  # no CA
        assert https_refused(url.replace("https", "http"), True)  # plaintext
        rotate(certs.rotated, cert, key)
        assert peer_serial(endpoint.port, certs.ca, certs.client) == certs.rotated.serial
        # a client that never speaks holds nothing up: the next one is answered
        with socket.create_connection(("127.0.0.1", endpoint.port)):
            again = httpx.get(url, verify=trust(certs.ca, certs.client), timeout=5)
        assert again.status_code == 200
    finally:
        endpoint.close()


# --- what reaches Kafka and PostgreSQL clients ----------------------------------------------


def test_kafka_ssl_and_sasl_settings_reach_every_client_config(certs: Certs) -> None:
    settings = Settings(kafka_bootstrap="broker:9093", kafka_security_protocol="SASL_SSL",
                        kafka_ssl_ca_file=certs.ca, kafka_ssl_cert_file=certs.client.cert,
                        kafka_ssl_key_file=certs.client.key, kafka_sasl_mechanism="SCRAM-SHA-512",
                        kafka_sasl_username="loraplane", kafka_sasl_password="s3cret")
    expected = {"security.protocol": "SASL_SSL", "ssl.ca.location": str(certs.ca),
                "ssl.certificate.location": str(certs.client.cert),
                "ssl.key.location": str(certs.client.key), "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "loraplane", "sasl.password": "s3cret"}
    for config in (producer_config(settings, "p"), consumer_config(settings, "c")):
        assert expected.items() <= config.items()
    assert security_config(Settings()) == {}
    with pytest.raises(ValueError, match="does not use the SASL settings"):
        security_config(Settings(kafka_security_protocol="SSL", kafka_sasl_username="x"))
    with pytest.raises(ValueError, match="does not use the SSL settings"):
        security_config(Settings(kafka_ssl_ca_file=certs.ca))
    with pytest.raises(ValueError, match="needs LORAPLANE_KAFKA_SASL_MECHANISM"):
        security_config(Settings(kafka_security_protocol="SASL_PLAINTEXT"))


def test_a_tls_kafka_client_does_not_talk_plaintext_to_a_plaintext_broker(
        kafka_bootstrap: str, certs: Certs) -> None:
    """The setting reaches librdkafka for real: an SSL client to the test's plaintext
    broker gets no metadata, where the same client without it does."""
    from confluent_kafka.admin import AdminClient

    from services.eventlog.client import base_config

    plain = AdminClient(base_config(Settings(kafka_bootstrap=kafka_bootstrap), "tls-probe"))
    assert plain.list_topics(timeout=10).brokers
    secure = AdminClient(base_config(Settings(kafka_bootstrap=kafka_bootstrap,
                                              kafka_security_protocol="SSL",
                                              kafka_ssl_ca_file=certs.ca), "tls-probe"))
    from confluent_kafka import KafkaException

    with pytest.raises(KafkaException):
        secure.list_topics(timeout=5)


def test_postgres_sslmode_reaches_libpq(database_url: str, certs: Certs) -> None:
    """sslmode=require against the test's PostgreSQL (no TLS) is refused by libpq itself;
    disable connects; the URL and the setting may not disagree."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from services.audit.db import make_engine

    required = Settings(database_url=database_url, database_sslmode="require")
    assert "sslmode=require" in str(required.database_url)
    engine = make_engine(str(required.database_url))
    try:
        with pytest.raises(OperationalError, match=r"(?i)ssl"), engine.connect():
            pass
    finally:
        engine.dispose()
    disabled = Settings(database_url=database_url, database_sslmode="disable",
                        database_sslrootcert=certs.ca)
    engine = make_engine(str(disabled.database_url))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("select 1")).scalar() == 1
    finally:
        engine.dispose()
    with pytest.raises(ValueError, match="sslmode=disable"):
        Settings(database_url=f"{database_url}{'&' if '?' in database_url else '?'}"
                              "sslmode=disable", database_sslmode="verify-full")
    with pytest.raises(ValueError, match="need LORAPLANE_DATABASE_URL"):
        Settings(database_sslmode="require")


def test_settings_name_what_is_missing() -> None:
    with pytest.raises(tls.TlsConfigError, match="both LORAPLANE_TLS_CERT_FILE"):
        tls.files_of(Settings(tls_cert_file=Path("/nonexistent.pem")))
    assert json.loads(json.dumps(Settings(tls_client_auth=["worker"]).tls_client_auth)) == \
        ["worker"]
