"""FlashInfer attention backend for sgl (plugin id ``attn-flashinfer``)."""

from __future__ import annotations

__all__: list[str] = []
