"""Qwen-family models for sgl (plugin id ``model-qwen``)."""

from __future__ import annotations

__all__: list[str] = []
