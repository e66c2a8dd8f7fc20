"""Mistral-family models for sgl (plugin id ``model-mistral``)."""

from __future__ import annotations

__all__: list[str] = []
