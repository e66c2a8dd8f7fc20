"""Speculative decoding: the base class algorithm plugins implement."""

from __future__ import annotations

from sgl.speculative.base import BaseSpeculativeAlgorithm

__all__ = ["BaseSpeculativeAlgorithm"]
