"""GET /hello: a route of the example plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

if TYPE_CHECKING:
    from sgl.server import ServerContext


def make_router(server: ServerContext) -> APIRouter:
    router = APIRouter(tags=["hello"])
    settings = server.settings.plugin_settings["hello"]

    @router.get("/hello")
    async def hello() -> dict[str, Any]:
        return {"message": f"{settings.greeting} from {server.model_name}",
                "attention_backend": server.settings.attention_backend}

    return router
