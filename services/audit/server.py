"""`loraplane serve audit`: the projector, and its HTTP endpoint for /metrics and
/checkpoints (`services.audit.publication`), in the foreground until `stop`."""

from __future__ import annotations

import logging
import threading

from services import tls
from services.audit.db import make_engine
from services.audit.projector import AuditProjector
from services.audit.publication import HttpEndpoint, http_app
from services.config import Settings

log = logging.getLogger("loraplane.audit")


def serve(settings: Settings, stop: threading.Event) -> None:
    if not settings.database_url or not settings.kafka_bootstrap:
        raise ValueError("set LORAPLANE_DATABASE_URL and LORAPLANE_KAFKA_BOOTSTRAP")
    engine = make_engine(settings.database_url)
    projector = AuditProjector(settings, engine)
    projector.open()
    endpoint = HttpEndpoint(settings.audit_http_host, settings.audit_metrics_port,
                            http_app(projector.folder, projector.metrics.registry),
                            tls.server_ssl_context(settings, "audit"))
    log.info("audit projector running; metrics and checkpoints on %s://%s:%d (%s)",
             "https" if tls.serves_tls(settings) else "http", settings.audit_http_host,
             endpoint.port, tls.describe(settings))
    try:
        projector.run(stop)
    finally:
        endpoint.close()
        projector.close()
        engine.dispose()
