"""How the server picks a data-parallel replica for each request (``--load-balance-method``).

``cache_aware`` follows SGLang's router: each replica's prefix cache is guessed from the
prompts sent to it (here as hashes of 16-token blocks, each chained to the blocks before it, so
that one hash stands for a whole prefix). A prompt goes to the replica that likely holds the
longest prefix of it when that covers at least half the prompt and the replicas' loads are
balanced; otherwise to the least loaded replica (ties: the one with the least cached), which
spreads new prefixes over the replicas.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from sgl.parallel import RequestRouter

__all__ = ["ROUTERS", "CacheAware", "RoundRobin", "ShortestQueue"]


class RoundRobin(RequestRouter):
    def __init__(self, size: int) -> None:
        self.size = size
        self.next = 0

    def pick(self, request: Any, in_flight: list[int]) -> int:
        replica, self.next = self.next, (self.next + 1) % self.size
        return replica


class ShortestQueue(RequestRouter):
    """The replica with the fewest requests in flight (the lowest index on ties)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def pick(self, request: Any, in_flight: list[int]) -> int:
        return min(range(self.size), key=lambda i: in_flight[i])


class CacheAware(RequestRouter):
    #: tokens per hashed block of a prompt
    BLOCK = 16
    #: the share of a prompt a replica must likely hold to be chosen for it
    CACHE_THRESHOLD = 0.5
    #: loads further apart than this (in requests, and as a ratio) go to the least loaded
    BALANCE_ABS_THRESHOLD = 32
    BALANCE_REL_THRESHOLD = 1.5
    #: blocks remembered per replica (the oldest forgotten first, as its cache evicts)
    CAPACITY = 1 << 18

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(size)]
        self.hits = 0

    def pick(self, request: Any, in_flight: list[int]) -> int:
        hashes = self._hashes(request.input_ids)
        matched = [self._matched(i, hashes) for i in range(self.size)]
        best = max(range(self.size), key=lambda i: (matched[i], -in_flight[i]))
        busiest, idlest = max(in_flight), min(in_flight)
        balanced = (busiest - idlest <= self.BALANCE_ABS_THRESHOLD
                    or busiest <= self.BALANCE_REL_THRESHOLD * idlest)
        if (hashes and balanced
                and matched[best] * self.BLOCK >= self.CACHE_THRESHOLD * len(request.input_ids)):
            replica = best
            self.hits += 1
        else:
            replica = min(range(self.size), key=lambda i: (in_flight[i], len(self.blocks[i])))
        self._remember(replica, hashes)
        return replica

    def describe(self) -> dict[str, Any]:
        return {"cache_aware_hits": self.hits,
                "cache_aware_blocks": [len(blocks) for blocks in self.blocks]}

    def _hashes(self, ids: list[int]) -> list[int]:
        hashes, prefix = [], 0
        for start in range(0, len(ids) - self.BLOCK + 1, self.BLOCK):
            prefix = hash((prefix, *ids[start:start + self.BLOCK]))
            hashes.append(prefix)
        return hashes

    def _matched(self, replica: int, hashes: list[int]) -> int:
        blocks = self.blocks[replica]
        for n, h in enumerate(hashes):
            if h not in blocks:
                return n
        return len(hashes)

    def _remember(self, replica: int, hashes: list[int]) -> None:
        blocks = self.blocks[replica]
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.CAPACITY:
            blocks.popitem(last=False)


ROUTERS: dict[str, type[RequestRouter]] = {
    "round_robin": RoundRobin, "shortest_queue": ShortestQueue, "cache_aware": CacheAware}
