"""Parallelism: the base class strategy plugins implement, and how the core picks one."""

from __future__ import annotations

from sgl.parallel.base import (
    BaseParallelStrategy,
    GroupFailure,
    RankInfo,
    RequestRouter,
    RunnerMirror,
)

__all__ = ["BaseParallelStrategy", "GroupFailure", "RankInfo", "RequestRouter", "RunnerMirror"]
