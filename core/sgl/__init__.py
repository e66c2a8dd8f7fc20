"""sgl: a plugin-based serving framework for large language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.hookspecs import hookimpl
from sgl.version import __version__

if TYPE_CHECKING:
    from sgl.entrypoints.engine import Engine

__all__ = ["Engine", "__version__", "hookimpl"]



#: names that plugin distributions provide at the top level: name -> (module, distribution)
_PLUGIN_NAMES: dict[str, tuple[str, str]] = {
    name: ("sgl_lang", "sgl-lang") for name in (
        "function", "gen", "gen_int", "gen_string", "select", "image", "system", "user",
        "assistant", "system_begin", "system_end", "user_begin", "user_end", "assistant_begin",
        "assistant_end", "set_default_backend", "get_default_backend", "RuntimeEndpoint",
        "OpenAI", "EngineBackend", "ProgramState", "token_length_normalized",
        "greedy_token_selection", "unconditional_likelihood_normalized", "BackendError",
        "LangError",
    )
}


def __getattr__(name: str) -> Any:
    # sgl.Engine is imported on first use, so that ``import sgl`` stays light
    if name == "Engine":
        from sgl.entrypoints.engine import Engine

        globals()["Engine"] = Engine
        return Engine
    if name in _PLUGIN_NAMES:
        import importlib

        module_name, distribution = _PLUGIN_NAMES[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            raise AttributeError(f"sgl.{name} is provided by the plugin {distribution!r}, which "
                                 f"is not installed: pip install {distribution}") from None
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sgl' has no attribute {name!r}")
