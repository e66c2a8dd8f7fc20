"""The outlines-core grammar backend for sgl."""

from __future__ import annotations

__all__: list[str] = []
