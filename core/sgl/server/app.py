"""The FastAPI application: core routes plus the routers of frontend plugins."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from sgl.server.context import ServerContext

__all__ = ["create_app"]

logger = logging.getLogger("sgl.server")


def create_app(server: ServerContext) -> FastAPI:
    """Build the app: ``/health`` from the core, everything else from frontend plugins."""

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

    registry = server.plugin_manager.registries.frontends
    for name in server.settings.frontends or registry.names():
        entry = registry.entry(name)
        router = entry.load()(server)
        app.include_router(router)
        logger.info("frontend %r mounted (plugin %s)", name, entry.owner)
    return app


async def _watch_scheduler(server: ServerContext) -> None:
    """If the scheduler dies, fail in-flight requests, turn unhealthy and exit non-zero."""
    while server.scheduler.alive:
        await asyncio.sleep(0.5)
    reason = (f"the scheduler process died (exit code {server.scheduler.process.exitcode}); "
              "the server is shutting down")
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
