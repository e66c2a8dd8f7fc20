"""Llama-family models for sgl (plugin id ``model-llama``)."""

from __future__ import annotations

__all__: list[str] = []
