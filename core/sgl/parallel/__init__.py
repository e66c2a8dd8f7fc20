"""Parallelism: the base class strategy plugins implement."""

from __future__ import annotations

from sgl.parallel.base import BaseParallelStrategy, RankInfo

__all__ = ["BaseParallelStrategy", "RankInfo"]
