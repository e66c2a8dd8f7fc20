"""sgl: a plugin-based serving framework for large language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.engine.engine import Engine

__all__ = ["Engine", "__version__", "hookimpl"]

try:
    from importlib.metadata import version as _version

    __version__ = _version("sgl")
except Exception:  # running from a source tree that is not installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    # sgl.Engine is imported on first use, so that ``import sgl`` stays light
    if name == "Engine":
        from sgl.engine.engine import Engine

        globals()["Engine"] = Engine
        return Engine
    raise AttributeError(f"module 'sgl' has no attribute {name!r}")
