"""Registers the Ollama frontend. No heavy imports here: the router is built on demand."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_frontends(register: Any) -> None:
    register("ollama", "sgl_frontend_ollama.routes:make_router")
