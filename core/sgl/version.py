"""The installed version of sgl."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("sgl")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
