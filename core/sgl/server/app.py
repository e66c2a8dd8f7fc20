"""The FastAPI application: core routes plus the routers of frontend plugins.

The core serves ``GET /health`` and ``GET /metrics`` and wraps every route, whatever plugin
mounted it, in the middleware of :mod:`sgl.server.middleware`: the API key, the body size limit
and cancellation of requests whose client went away.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from sgl.server.http import SCHEMAS_KEY
from sgl.server.io_struct import GenerateError
from sgl.server.metrics import CONTENT_TYPE_LATEST
from sgl.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    CancelOnDisconnectMiddleware,
)

if TYPE_CHECKING:
    from sgl.server.context import ServerContext

__all__ = ["create_app"]

logger = logging.getLogger("sgl.server")


def create_app(server: ServerContext) -> FastAPI:
    """Build the app: ``/health`` and ``/metrics`` from the core, everything else from
    frontend plugins, all behind the core's middleware."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.tokenizer_manager.start()
        watchdog = asyncio.create_task(_watch_scheduler(server), name="sgl-watchdog")
        try:
            yield
        finally:
            watchdog.cancel()
            await server.tokenizer_manager.stop()

    app = FastAPI(title="sgl", version=_version(), lifespan=lifespan)
    app.state.sgl = server

    @app.get("/health", tags=["core"])
    async def health() -> JSONResponse:
        """200 while the scheduler process is alive, 503 once it is gone."""
        if server.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy",
                             "reason": server.tokenizer_manager.dead_reason}, status_code=503)

    @app.get("/metrics", tags=["core"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus metrics: request counters and latency histograms, and the scheduler's
        load as gauges."""
        tm = server.tokenizer_manager
        try:
            loads = await tm.get_loads()
            tm.metrics.set_load(tm.add_loads(loads))
            tm.metrics.set_replica_loads(loads)
        except GenerateError:  # the scheduler is gone: still serve the counters
            pass
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # the last added runs first: the key, then the size limit, then disconnect handling
    app.add_middleware(CancelOnDisconnectMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, limit=server.settings.max_request_body_size)
    if server.settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server.settings.api_key)

    registry = server.plugin_manager.registries.frontends
    for name in server.settings.frontends or registry.names():
        entry = registry.entry(name)
        router = entry.load()(server)
        app.include_router(router)
        logger.info("frontend %r mounted (plugin %s)", name, entry.owner)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with the sub-schemas of the documented bodies in ``components``."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for operation in (op for path in schema["paths"].values() for op in path.values()):
                components.update(operation.pop(SCHEMAS_KEY, {}))
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _watch_scheduler(server: ServerContext) -> None:
    """If the scheduler dies, fail in-flight requests, turn unhealthy and exit non-zero."""
    while server.scheduler.alive:
        await asyncio.sleep(0.5)
    reason = f"{server.scheduler.death_reason()}; the server is shutting down"
    logger.error("%s", reason)
    server.tokenizer_manager.fail_all(reason)
    server.exit_code = 1
    await asyncio.sleep(1.0)  # let health checks see the 503 before the port closes
    if server.uvicorn_server is not None:
        server.uvicorn_server.should_exit = True


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sgl")
    except PackageNotFoundError:
        return "0+unknown"
