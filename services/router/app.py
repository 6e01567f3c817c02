"""Wiring of `loraplane serve router`: one asyncio loop runs the gRPC server, the HTTP
server (uvicorn) and the fold of the log, so the state the request path reads is only
ever changed on that loop's thread, between two requests' decisions.

Stop (SIGTERM, SIGINT): the drain. gRPC health NOT_SERVING, new gRPC calls refused
UNAVAILABLE ("router is draining"), the HTTP listener closed, and the calls in flight,
streams included, get `router_drain_s` to finish before the process exits (clients with
another router fail over to it).

Start-up: both servers listen at once (gRPC health NOT_SERVING, HTTP `/readyz` 503, and
requests answered UNAVAILABLE / 503 with a retry hint), while the shared log follower
(`services.eventlog.follower`) folds the log to its end from the newest snapshot of the
router's fold (`services.router.fold`) in its own thread; then the router is ready. A
broker that is down at start is retried. A broker that goes down later leaves the router
serving from the state it has; a worker whose heartbeats cannot be read is not taken out
for that (`services.router.membership`: only once its partition is read again, or after
the stall grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator

import uvicorn

from services import tls
from services.catalog.auth import TokenBook
from services.config import Settings
from services.eventlog.follower import FollowerHalted, LogFollower
from services.router.dispatch import Dispatcher
from services.router.fold import RouterFold
from services.router.metrics import RouterMetrics
from services.router.openai_routes import create_http_app
from services.router.server import RouterHealth, build_server
from services.router.witness import CutWitness

log = logging.getLogger("loraplane.router")

TICK_S = 0.1
"""How often silent workers are looked for (and unused channels closed)."""


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our loop: the router, not uvicorn, owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RouterApp:
    def __init__(self, settings: Settings, *, router_id: str | None = None,
                 grpc_port: int | None = None, http_port: int | None = None) -> None:
        self.settings = settings
        self.router_id = router_id or settings.router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.metrics = RouterMetrics()
        self.dispatcher = Dispatcher(settings, self.metrics)
        self.witness = CutWitness(settings, self.router_id)
        self.dispatcher.witness = self.witness
        self.tokens = TokenBook.from_setting(settings.auth_tokens)
        self.fold = RouterFold(self.dispatcher, self.witness)
        self.follower = LogFollower(settings, self.fold, reader_id=self.router_id,
                                    snapshot_name="router", on_ready=self._caught_up)
        self.dispatcher.catch_up = self._catch_up
        self.grpc_port = settings.router_port if grpc_port is None else grpc_port
        self.http_port = settings.router_http_port if http_port is None else http_port
        self.health = RouterHealth()
        self._stop: asyncio.Event | None = None
        self._replayed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: _EmbeddedUvicorn | None = None

    def stop(self) -> None:
        """Ask a running `run` to finish (from any thread)."""
        if self._stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self, on_listening: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._replayed = asyncio.Event()
        host = self.settings.router_host
        grpc_server, self.grpc_port = build_server(self.dispatcher, self.tokens, self.health,
                                                   f"{host}:{self.grpc_port}", self.settings)
        await self.health.set(False)
        await grpc_server.start()
        self._http = _EmbeddedUvicorn(tls.uvicorn_ssl(uvicorn.Config(
            create_http_app(self.dispatcher, self.tokens), host=host, port=self.http_port,
            log_level=self.settings.log_level.lower(), lifespan="off",
            timeout_graceful_shutdown=max(1, round(self.settings.router_drain_s))),
            self.settings, "router"))
        http_task = asyncio.create_task(self._http.serve())
        while not self._http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await grpc_server.stop(0)
            http_task.result()
            raise OSError(f"HTTP server did not start on {host}:{self.http_port}")
        log.info("router %s listening: gRPC %s:%d, HTTP %s:%d; %s", self.router_id, host,
                 self.grpc_port, host, self.http_port, tls.describe(self.settings))
        if on_listening is not None:
            on_listening()
        fold_task = asyncio.create_task(self._follow())
        try:
            await self._stop.wait()
        finally:
            fold_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fold_task
            # the drain: NOT_SERVING, no new calls on either front, those in flight get
            # `router_drain_s` to finish
            await self.health.set(False)
            self.metrics.ready.set(0)
            log.info("router %s draining: up to %.0f s for the requests in flight",
                     self.router_id, self.settings.router_drain_s)
            self._http.should_exit = True
            # gRPC's own stop refuses a call that races it with CANCELLED, which clients
            # do not retry: the router refuses new calls itself (UNAVAILABLE) until those
            # in flight are done, and stops its server only then
            self.dispatcher.start_draining()
            loop = asyncio.get_running_loop()
            until = loop.time() + self.settings.router_drain_s
            while self.dispatcher.in_flight and loop.time() < until:
                await asyncio.sleep(0.05)
            await grpc_server.stop(grace=max(0.0, until - loop.time()))
            await http_task
            await self.dispatcher.close()
            await asyncio.to_thread(self.witness.stop)
            await asyncio.to_thread(self.follower.stop)
            self.metrics.ready.set(0)

    async def _follow(self) -> None:
        d = self.dispatcher
        assert self._replayed is not None
        self.follower.start()
        await self._replayed.wait()
        d.tick()
        self.witness.start()
        d.start_serving()
        self.metrics.ready.set(1)
        await self.health.set(True)
        status = self.follower.status()
        log.info("router %s ready: from the %s, %d events folded, %d workers in the ring",
                 self.router_id, status["started_from"], status["folded"], len(d.ring))
        while True:
            await asyncio.sleep(TICK_S)
            d.tick()

    def _caught_up(self) -> None:
        """The follower's `on_ready` (its thread): the replay is folded; from now on records
        are folded on the event loop, which then starts serving."""
        assert self._loop is not None and self._replayed is not None
        self.fold.go_live(self._loop)
        self._loop.call_soon_threadsafe(self._replayed.set)

    async def _catch_up(self, timeout_s: float) -> bool:
        """Fold everything committed to the log before this call (at most `timeout_s`):
        True once it is folded."""
        try:
            caught = await asyncio.to_thread(self.follower.sync, timeout_s)
        except FollowerHalted:
            return False
        self.fold.drain()
        return caught


def serve(settings: Settings) -> None:
    """`loraplane serve router` in the foreground; SIGINT / SIGTERM stop it gracefully."""
    import signal

    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = RouterApp(settings)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, app.stop)
        await app.run()

    asyncio.run(main())
