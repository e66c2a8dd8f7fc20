"""Phi-family models for sgl (plugin id ``model-phi``)."""

from __future__ import annotations

__all__: list[str] = []
