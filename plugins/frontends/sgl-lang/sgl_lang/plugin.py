"""The plugin module of sgl-lang: adds ``sgl lang run SCRIPT`` to the command line.

The language itself is a library (``import sgl`` then ``sgl.function``, ``sgl.gen``, ...); the
core finds it through this distribution. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import runpy
import sys
from typing import TYPE_CHECKING

from sgl import hookimpl

if TYPE_CHECKING:
    import click

__all__ = ["sgl_register_commands"]


@hookimpl
def sgl_register_commands(cli: click.Group) -> None:
    import click

    @cli.group(name="lang", help="SGLang's frontend language (plugin sgl-lang).")
    def lang() -> None:
        pass

    @lang.command(name="run", context_settings={"ignore_unknown_options": True})
    @click.argument("script", type=click.Path(exists=True, dir_okay=False))
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    @click.option("--url", default="http://127.0.0.1:30000", show_default=True,
                  help="the sgl (or SGLang) server the program runs on")
    @click.option("--api-key", default=None, help="the server's API key")
    def run(script: str, args: tuple[str, ...], url: str, api_key: str | None) -> None:
        """Run a Python SCRIPT with the default backend set to the server at --url."""
        from sgl_lang import RuntimeEndpoint, set_default_backend

        set_default_backend(RuntimeEndpoint(url, api_key=api_key))
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
