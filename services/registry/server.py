"""`loraplane serve registry`: the app under uvicorn, in the foreground.

uvicorn installs the SIGINT/SIGTERM handlers: on either it stops accepting connections,
lets requests in flight finish, and runs the lifespan shutdown (the node stops leasing,
flushes its producer and closes its consumer) before the process exits.
"""

from __future__ import annotations

import logging

import uvicorn

from services import tls
from services.config import Settings
from services.registry.app import create_app


def serve(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(create_app(settings, registry_id=settings.registry_id),
                            host=settings.registry_host,
                            port=settings.registry_port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=10)
    logging.getLogger("loraplane.registry").info("registry listener: %s",
                                                  tls.describe(settings))
    uvicorn.Server(tls.uvicorn_ssl(config, settings, "registry")).run()
