"""Log set-up shared by the server and scheduler processes."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]


def setup_logging(level: str = "info", process: str = "server") -> None:
    """Send sgl's logs to stderr as ``time LEVEL [process] message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)-7s [{process}] %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
