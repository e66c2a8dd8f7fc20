"""RadixAttention prefix cache for sgl (plugin id ``cache-radix``)."""

from __future__ import annotations

__all__: list[str] = []
