"""sgl: a plugin-based serving framework for large language models."""

from __future__ import annotations

from sgl.hookspecs import hookimpl

__all__ = ["__version__", "hookimpl"]

try:
    from importlib.metadata import version as _version

    __version__ = _version("sgl")
except Exception:  # running from a source tree that is not installed
    __version__ = "0+unknown"
