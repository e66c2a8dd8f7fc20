"""The data-parallel request routers on their own (the server-side choice of a replica), and the
server's Replicas bookkeeping around them: pure Python, no processes."""

from __future__ import annotations

import pytest

from sgl.engine.messages import GenerateRequest
from sgl.sampling import SamplingParams
from sgl.server.io_struct import BadRequestError
from sgl.server.replicas import Replicas
from sgl_parallel_dp.routers import CacheAware, RoundRobin, ShortestQueue


def request(rid: str, ids: list[int], **fields: object) -> GenerateRequest:
    return GenerateRequest(rid, ids, SamplingParams(), **fields)  # type: ignore[arg-type]


PREFIX = list(range(100, 164))  # four 16-token blocks


def test_round_robin_and_shortest_queue() -> None:
    rr = RoundRobin(3)
    assert [rr.pick(request(str(i), [1]), [0, 0, 0]) for i in range(5)] == [0, 1, 2, 0, 1]
    sq = ShortestQueue(3)
    assert sq.pick(request("a", [1]), [2, 0, 1]) == 1
    assert sq.pick(request("b", [1]), [1, 1, 1]) == 0  # ties: the lowest index


def test_cache_aware_follows_the_prefix_then_balances() -> None:
    ca = CacheAware(2)
    # nothing cached anywhere: the least loaded, ties to the one holding least
    assert ca.pick(request("a", [*PREFIX, 1]), [0, 0]) == 0
    assert ca.pick(request("b", [*range(500, 564), 2]), [0, 0]) == 1
    # a prompt that shares a prefix goes where the prefix is, even if that replica is busier
    assert ca.pick(request("c", [*PREFIX, 3, 4]), [5, 0]) == 0
    assert ca.hits == 1
    # ... unless the loads are too far apart (over 32 requests and over 1.5x)
    assert ca.pick(request("d", [*PREFIX, 5]), [40, 2]) == 1
    # a prompt that shares less than half its length with every replica is balanced
    short_share = [*PREFIX[:16], *range(900, 964)]
    assert ca.pick(request("e", short_share), [3, 1]) == 1
    # hashes chain the blocks: the same block after a different prefix is no match
    assert ca._matched(0, ca._hashes([*range(7, 23), *PREFIX])) == 0


def test_cache_aware_forgets_the_oldest_blocks() -> None:
    ca = CacheAware(1)
    ca.CAPACITY = 8
    for i in range(5):
        ca.pick(request(str(i), list(range(i * 1000, i * 1000 + 32))), [0])
    assert len(ca.blocks[0]) == 8
    assert ca._matched(0, ca._hashes(list(range(32)))) == 0  # the first prompt's blocks left


def test_replicas_assign_release_and_explicit_ranks() -> None:
    replicas = Replicas(["ipc://a", "ipc://b"], ShortestQueue(2))
    assert replicas.assign(request("x", [1])) == 0
    assert replicas.assign(request("y", [1])) == 1
    assert replicas.assign(request("z", [1], data_parallel_rank=1)) == 1  # asked for
    assert replicas.in_flight == [1, 2] and replicas.of("z") == [1]
    assert replicas.of("unknown") == [0, 1]  # an abort of an unknown id goes everywhere
    replicas.release("z")
    replicas.release("z")  # twice: counted once
    assert replicas.in_flight == [1, 1]
    session = replicas.assign(request("s", [1], session_id="chat-1"))
    assert session == replicas.session_replica("chat-1")
    with pytest.raises(BadRequestError, match="data_parallel_rank 2: this server has 2"):
        replicas.assign(request("w", [1], data_parallel_rank=2))
    with pytest.raises(ValueError, match="need a request router"):
        Replicas(["ipc://a", "ipc://b"])
