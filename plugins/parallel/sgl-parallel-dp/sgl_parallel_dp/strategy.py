"""Data parallelism: ``--dp-size N`` whole schedulers (replicas) behind one server.

Each replica is a scheduler process of its own, with the whole model, its own KV pool and
prefix cache, on an equal share of the cores; it listens on its own requests socket and answers
on the server's one outputs socket. The server's
:class:`~sgl.server.replicas.Replicas` sends each request to the replica the router of
``--load-balance-method`` picks (:mod:`sgl_parallel_dp.routers`), a session's requests to the
session's replica, and control messages (flush the cache, server info) to all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.parallel import BaseParallelStrategy, RankInfo, RequestRouter
from sgl.threads import take_core_share
from sgl_parallel_dp.routers import ROUTERS
from sgl_parallel_dp.settings import load_balance_method

if TYPE_CHECKING:
    from sgl.config import ServerSettings

__all__ = ["DataParallel"]


class DataParallel(BaseParallelStrategy):
    """``--dp-size N`` with ``--load-balance-method``."""

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> DataParallel | None:
        return cls(settings) if settings.dp_size > 1 else None

    @property
    def method(self) -> str:
        return load_balance_method(self.settings)

    def local_ranks(self, init_addr: str) -> list[RankInfo]:
        size = self.settings.dp_size
        return [RankInfo(strategy="dp", rank=0, world_size=1, local_rank=i, local_size=size,
                         init_addr=init_addr, replica=i) for i in range(size)]

    def init_process(self, rank: RankInfo) -> None:
        take_core_share(rank.local_rank, rank.local_size)
        if self.settings.device != "cpu":
            import torch

            from sgl.devices import resolve_device

            if resolve_device(self.settings.device).type == "cuda":
                # replica i of this machine on GPU i (round robin when there are fewer)
                torch.cuda.set_device(rank.local_rank % torch.cuda.device_count())

    def lead(self, runner: Any) -> None:
        """Every replica leads itself: nothing to mirror."""

    def follow(self, runner: Any) -> None:
        raise RuntimeError("a data-parallel replica has no leader to follow")

    def request_router(self) -> RequestRouter:
        return ROUTERS[self.method](self.settings.dp_size)

    def describe(self) -> dict[str, Any]:
        return {"dp_size": self.settings.dp_size, "load_balance_method": self.method}
