"""HTTP frontends: the routes mounted on the server's FastAPI app."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_frontends(register: RegisterFn) -> None:
    """Register HTTP frontends by name.

    Call ``register(name, "module:make_router")``. ``make_router(server)`` receives the
    :class:`sgl.server.ServerContext` (settings, tokenizer manager, model info) and returns a
    :class:`fastapi.APIRouter`, which the server mounts. Every registered frontend is mounted
    unless ``--frontends`` names a subset. Two frontends registering the same name is an error
    naming both plugins.

    :param register: ``register(name: str, target: str | Callable) -> None``.
    :return: nothing.

    Runs in: every process when the registries are built; ``make_router`` is called only in the
    server process, when the FastAPI app is built.

    .. versionadded:: 0.1
    """
