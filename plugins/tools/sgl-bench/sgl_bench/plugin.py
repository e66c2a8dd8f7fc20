"""Registers ``sgl bench``. Only click is imported here; each command imports what it needs
(aiohttp, httpx, the tokenizer, torch) when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def sgl_register_commands(cli: click.Group) -> None:
    from sgl_bench.cli import bench

    cli.add_command(bench)
