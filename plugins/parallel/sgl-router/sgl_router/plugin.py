"""Registers the ``sgl router`` command; imports nothing heavy."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_commands(cli: Any) -> None:
    from sgl_router.command import router

    cli.add_command(router)
