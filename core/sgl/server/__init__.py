"""The HTTP server process."""

from __future__ import annotations

from sgl.server.context import ServerContext

__all__ = ["ServerContext"]
