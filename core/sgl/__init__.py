"""sgl: a plugin-based serving framework for large language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.hookspecs import hookimpl
from sgl.version import __version__

if TYPE_CHECKING:
    from sgl.entrypoints.engine import Engine

__all__ = ["Engine", "__version__", "hookimpl"]

_plugins: Any = None  # the plugin manager that sgl_register_api_names is read from


def _plugin_name(name: str) -> Any:
    global _plugins
    if _plugins is None:
        from sgl.plugins import PluginSelection, create_plugin_manager

        _plugins = create_plugin_manager(PluginSelection.from_args())
    names = _plugins.registries.api_names
    if name not in names:
        # plugins that failed to load could have registered it; those this machine cannot
        # run (no GPU) are no news here
        unavailable = "".join(f"; plugin {r.name!r} is unavailable: {r.reason}"
                              for r in _plugins.records.values()
                              if not r.available and not r.machine_limited)
        raise AttributeError(f"module 'sgl' has no attribute {name!r} (no loaded plugin "
                             f"registers it through sgl_register_api_names{unavailable})")
    return names.load(name)


def __getattr__(name: str) -> Any:
    # sgl.Engine is imported on first use, so that ``import sgl`` stays light
    if name == "Engine":
        from sgl.entrypoints.engine import Engine

        globals()["Engine"] = Engine
        return Engine
    if name.startswith("__"):  # the import system and tools probe these
        raise AttributeError(f"module 'sgl' has no attribute {name!r}")
    value = _plugin_name(name)  # names plugins add: sgl.function, sgl.gen, ... (sgl-lang)
    globals()[name] = value
    return value
