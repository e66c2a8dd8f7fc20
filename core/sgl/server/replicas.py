"""The server's sockets to its scheduler replicas, and which replica takes each request.

One scheduler (or one tensor-parallel group, whose leader alone talks to the server) is one
replica. With data parallelism (``--dp-size N``) the server has N: each listens on its own
``requests`` socket and all answer on the one ``outputs`` socket. A generation request goes to
the replica it names (``data_parallel_rank``, which SGLang's router sends with ``--dp-aware``),
else to the session's replica, else to the one a :class:`~sgl.parallel.RequestRouter` picks; its
abort follows it there. Control messages go to every replica.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from sgl.engine.messages import GenerateRequest
from sgl.server.io_struct import BadRequestError

if TYPE_CHECKING:
    from sgl.parallel import RequestRouter

__all__ = ["Replicas"]


class Replicas:
    """``endpoints`` is the requests socket of each replica; ``router`` picks among several
    (None: the first, the only one)."""

    def __init__(self, endpoints: list[str], router: RequestRouter | None = None) -> None:
        if len(endpoints) > 1 and router is None:
            raise ValueError(f"{len(endpoints)} scheduler replicas need a request router")
        self.endpoints = endpoints
        self.router = router
        self.sockets: list[zmq.asyncio.Socket] = []
        #: the replica of each request in flight, and how many each one has
        self.owner: dict[str, int] = {}
        self.in_flight = [0] * len(endpoints)

    def __len__(self) -> int:
        return len(self.endpoints)

    def bind(self, context: zmq.asyncio.Context) -> None:
        for endpoint in self.endpoints:
            socket = context.socket(zmq.PUSH)
            socket.bind(endpoint)
            self.sockets.append(socket)

    def close(self) -> None:
        for socket in self.sockets:
            socket.close(linger=100)
        self.sockets = []

    def session_replica(self, session_id: str) -> int:
        """Every request of a session, and its open and close, go to one replica (which keeps
        the conversation cached)."""
        return zlib.crc32(session_id.encode()) % len(self)

    def assign(self, msg: GenerateRequest) -> int:
        """The replica that takes ``msg``, remembered until :meth:`release`."""
        if msg.data_parallel_rank is not None:
            if msg.data_parallel_rank >= len(self):
                raise BadRequestError(f"data_parallel_rank {msg.data_parallel_rank}: this server "
                                      f"has {len(self)} replica(s) (--dp-size)",
                                      param="data_parallel_rank")
            replica = msg.data_parallel_rank
        elif len(self) == 1:
            replica = 0
        elif msg.session_id is not None:
            replica = self.session_replica(msg.session_id)
        else:
            assert self.router is not None
            replica = self.router.pick(msg, list(self.in_flight))
            if not 0 <= replica < len(self):
                raise RuntimeError(f"the request router picked replica {replica} of {len(self)}")
        self.owner[msg.rid] = replica
        self.in_flight[replica] += 1
        return replica

    def release(self, rid: str) -> None:
        """``rid`` is over: it no longer counts for its replica."""
        replica = self.owner.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1
            if self.router is not None:
                self.router.finished(rid, replica)

    def of(self, rid: str) -> list[int]:
        """The replica running ``rid``, or all when it is not known."""
        replica = self.owner.get(rid)
        return list(range(len(self))) if replica is None else [replica]

    def info(self) -> dict[str, Any]:
        """What ``/get_server_info`` shows of the dispatch."""
        if len(self) == 1:
            return {}
        return {"dp_size": len(self), "requests_in_flight": list(self.in_flight),
                **(self.router.describe() if self.router is not None else {})}
