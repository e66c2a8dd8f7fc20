"""Triton attention backend for sgl (plugin id ``attn-triton``), for CUDA GPUs."""

from __future__ import annotations

__all__: list[str] = []
