"""The runtime: scheduler process, model runner, batches, and the in-process ``Engine``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl.engine.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # imported on first use: the scheduler process imports this package and needs none of it
    if name == "Engine":
        from sgl.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'sgl.engine' has no attribute {name!r}")
