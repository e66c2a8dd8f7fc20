"""Registers the Anthropic frontend. No heavy imports here: the router is built on demand."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_frontends(register: Any) -> None:
    register("anthropic", "sgl_frontend_anthropic.routes:make_router")
