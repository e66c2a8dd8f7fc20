"""Pure-PyTorch attention backend for sgl (plugin id ``attn-torch``)."""

from __future__ import annotations

__all__: list[str] = []
