"""The runtime: scheduler process, model runner, batches."""

from __future__ import annotations

__all__: list[str] = []
