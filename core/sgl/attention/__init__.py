"""Attention backends: the base class plugins implement."""

from __future__ import annotations

from sgl.attention.base import AttentionLayerSpec, BaseAttentionBackend

__all__ = ["AttentionLayerSpec", "BaseAttentionBackend"]
