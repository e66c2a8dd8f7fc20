"""The plugin module of sgl-lang: adds ``sgl lang run SCRIPT`` to the command line and the
language's names to ``sgl`` (``sgl.function``, ``sgl.gen``, ...; hook
``sgl_register_api_names``). Importing this module imports nothing heavy.
"""

from __future__ import annotations

import runpy
import sys
from typing import TYPE_CHECKING

from sgl import hookimpl

if TYPE_CHECKING:
    import click

    from sgl.registry import RegisterFn

__all__ = ["API_NAMES", "sgl_register_api_names", "sgl_register_commands"]

#: what ``import sgl`` exposes of the language, as SGLang's ``sglang`` package does
API_NAMES = (
    "function", "gen", "gen_int", "gen_string", "select", "image", "system", "user", "assistant",
    "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "set_default_backend", "get_default_backend", "RuntimeEndpoint", "OpenAI", "EngineBackend",
    "ProgramState", "token_length_normalized", "greedy_token_selection",
    "unconditional_likelihood_normalized", "BackendError", "LangError",
)


@hookimpl
def sgl_register_api_names(register: RegisterFn) -> None:
    for name in API_NAMES:
        register(name, f"sgl_lang:{name}")


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
