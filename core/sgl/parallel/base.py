"""The interface of parallelism strategies."""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["BaseParallelStrategy", "RankInfo"]


class RankInfo:
    """Where one scheduler process sits: its rank and the world it belongs to."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size


class BaseParallelStrategy(ABC):
    """Decides how many scheduler processes start and what each of them owns."""

    def __init__(self, *, size: int) -> None:
        self.size = size

    @abstractmethod
    def ranks(self) -> list[RankInfo]:
        """One entry per scheduler process to start."""

    @abstractmethod
    def init_process(self, rank: RankInfo) -> None:
        """Set up communication (process groups) inside the process of ``rank``."""
