"""The interface of parallelism strategies: how one server spreads over scheduler processes.

A strategy decides which scheduler processes ("ranks") start on this node, sets up their
communication inside each of them, and splits the work between rank 0, the *leader* (the one
scheduler that talks to the server and decides every batch), and the other ranks, which follow
it. The core runs it:

1. in the server (or ``sgl.Engine``) process, :meth:`BaseParallelStrategy.from_settings` on every
   registered strategy; at most one may be on. Its :meth:`~BaseParallelStrategy.local_ranks`
   say which processes this node starts (:func:`sgl.engine.launch.start_scheduler`);
2. in each rank's process, :meth:`~BaseParallelStrategy.init_process` before the model is built
   (process groups, :func:`sgl.layers.tp.set_tp_group`, CPU cores);
3. on the leader, :meth:`~BaseParallelStrategy.lead` once its :class:`~sgl.engine.scheduler.Scheduler`
   exists; on every other rank, :meth:`~BaseParallelStrategy.follow` with the rank's own
   :class:`~sgl.engine.model_runner.ModelRunner`, until the leader stops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sgl.config import ServerSettings
    from sgl.forward_batch import ForwardBatch

__all__ = ["BaseParallelStrategy", "GroupFailure", "RankInfo", "RequestRouter", "RunnerMirror"]


class GroupFailure(BaseException):
    """A collective between ranks failed (a rank died or stopped answering): the ranks can no
    longer agree on a forward, so the scheduler stops, failing every request, rather than
    retry request by request. A ``BaseException`` so that the scheduler's per-request
    ``except Exception`` handlers let it through."""


@dataclass(frozen=True)
class RankInfo:
    """Where one scheduler process sits.

    :param strategy: the registered name of the strategy that started it.
    :param rank: its rank among all ranks of all nodes; 0 is the leader.
    :param world_size: how many ranks there are in all.
    :param local_rank: its place among the ranks of its node (which CPU cores it takes).
    :param local_size: how many ranks its node runs.
    :param init_addr: ``host:port`` where the ranks meet (torch.distributed's TCP store).
    :param replica: the data-parallel replica it belongs to (0 without data parallelism).
    :param rendezvous_dir: a directory of this launch that only its user can open (mode 0700),
        where ranks of one machine can meet through a file instead of a TCP port ("": none).
    """

    strategy: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    init_addr: str
    #: which replica (set of ranks behind one leader, with its own requests socket) it serves
    replica: int = 0
    rendezvous_dir: str = ""

    @property
    def leader(self) -> bool:
        """Rank 0 of its replica: the one scheduler of those ranks."""
        return self.rank == 0

    @property
    def label(self) -> str:
        """``tp rank 1``, or ``dp replica 1`` for a replica of one rank (for logs, messages)."""
        if self.world_size == 1:
            return f"{self.strategy} replica {self.replica}"
        return f"{self.strategy} rank {self.rank}"

    @property
    def tag(self) -> str:
        """``tp1``, ``dp1``: the process's tag in log lines."""
        return f"{self.strategy}{self.replica if self.world_size == 1 else self.rank}"


class RunnerMirror(ABC):
    """What the leader's :class:`~sgl.engine.model_runner.ModelRunner` tells the other ranks
    before each call that runs collectives, so that they run the same call on their shards."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> None:
        """The leader is about to run ``batch``."""

    @abstractmethod
    def logits_at(self, indices: torch.Tensor) -> None:
        """The leader is about to compute the logits of rows ``indices`` of the last forward's
        hidden states."""

    @abstractmethod
    def close(self) -> None:
        """The leader stops; the other ranks leave :meth:`BaseParallelStrategy.follow`."""


class BaseParallelStrategy(ABC):
    """One way of spreading a server over several scheduler processes (tensor parallelism,
    pipeline parallelism, ...). Register the class with ``sgl_register_parallel_strategies``.

    :param settings: the server's settings (the core's ``--tp-size``, ``--nnodes``, ... and the
        plugins' own options).
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: ServerSettings) -> BaseParallelStrategy | None:
        """The strategy these settings turn on, else None (the server runs without it)."""

    @classmethod
    def check_settings(cls, settings: ServerSettings) -> str | None:
        """Why these settings cannot run with this strategy (a message naming the flags), else
        None. Called before any process starts."""
        return None

    @abstractmethod
    def local_ranks(self, init_addr: str) -> list[RankInfo]:
        """The ranks this node starts, leader first where this node has it. ``init_addr`` is
        ``--dist-init-addr``, or a free loopback port the launcher chose when it is unset."""

    @abstractmethod
    def init_process(self, rank: RankInfo) -> None:
        """In the process of ``rank``, before the model is built: join the other ranks and set
        what the layers read (:func:`sgl.layers.tp.set_tp_group`)."""

    @abstractmethod
    def lead(self, runner: Any) -> None:
        """On the leader, once its model is loaded: give ``runner`` its
        :attr:`~sgl.engine.model_runner.ModelRunner.mirror`."""

    @abstractmethod
    def follow(self, runner: Any) -> None:
        """On every other rank: run what the leader's mirror announces on ``runner`` until the
        leader closes it. Raises :class:`GroupFailure` when the leader is gone."""

    def request_router(self) -> RequestRouter | None:
        """In the server process: what picks a replica for each request when this machine
        starts several leaders (data parallelism); None for one leader."""
        return None

    def describe(self) -> dict[str, Any]:
        """What ``/get_server_info`` shows of the strategy."""
        return {}


class RequestRouter(ABC):
    """Which scheduler replica takes each generation request (data parallelism). Lives in the
    server process; a session's requests bypass it (they stay on the session's replica)."""

    @abstractmethod
    def pick(self, request: Any, in_flight: list[int]) -> int:
        """The replica (index) for ``request`` (a :class:`sgl.engine.messages.GenerateRequest`:
        ``rid``, ``input_ids``, ``sampling``); ``in_flight`` counts each replica's requests that
        have not finished."""

    def finished(self, rid: str, replica: int) -> None:
        """Request ``rid`` on ``replica`` is over."""

    def describe(self) -> dict[str, Any]:
        """What ``/get_server_info`` shows of the router."""
        return {}
