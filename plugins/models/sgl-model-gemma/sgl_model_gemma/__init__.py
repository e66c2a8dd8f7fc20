"""Gemma-family models for sgl (plugin id ``model-gemma``)."""

from __future__ import annotations

__all__: list[str] = []
