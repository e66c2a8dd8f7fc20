"""The order in which waiting requests are admitted (``--schedule-policy``).

* ``lpm``, longest prefix match: requests with the most tokens already in the prefix cache go
  first, so cached prefixes are used before they are evicted;
* ``dfs-weight``: depth-first over the cache tree, heavier subtrees (more waiting requests under
  them) first, so requests sharing a prefix run back to back;
* ``fcfs``: arrival order; ``lof``: longest requested output first; ``random``.

The two cache-aware policies look up every waiting request in the cache on each admission
round; above :data:`CACHE_AWARE_QUEUE_LIMIT` waiting requests that costs more than it saves and
they fall back to fcfs, as SGLang does. They also share prefixes *within* the queue (see
:func:`defer_for_sharing`).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl.engine.sequence import Req
    from sgl.kvcache import BaseCachePolicy, PrefixMatch

__all__ = ["CACHE_AWARE_POLICIES", "CACHE_AWARE_QUEUE_LIMIT", "IN_QUEUE_SHARING_TOKENS",
           "defer_for_sharing", "order_waiting"]

CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
#: more waiting requests than this: cache-aware policies fall back to fcfs
CACHE_AWARE_QUEUE_LIMIT = 128
#: requests sharing at least this many leading tokens share their prefix in the queue
IN_QUEUE_SHARING_TOKENS = 32


def order_waiting(policy: str, waiting: Sequence[Req], cache: BaseCachePolicy,
                  match_len: Callable[[Req], int]) -> tuple[list[Req], dict[int, PrefixMatch]]:
    """Waiting requests in admission order, and the cache match of each (by ``id(req)``) where
    the policy looked them up.

    :param match_len: ``match_len(req)``: how many leading tokens of ``req`` may come from
        the cache (its sequence minus at least one token to compute).
    """
    reqs = list(waiting)
    if policy == "lof":
        return sorted(reqs, key=lambda r: -r.remaining_new_tokens()), {}
    if policy == "random":
        random.shuffle(reqs)
        return reqs, {}
    if policy not in CACHE_AWARE_POLICIES or len(reqs) > CACHE_AWARE_QUEUE_LIMIT:
        return reqs, {}
    matches = {id(r): cache.match_prefix(r.token_slice(0, match_len(r))) for r in reqs}
    if policy == "lpm":
        return sorted(reqs, key=lambda r: -len(matches[id(r)])), matches
    return _dfs_weight(reqs, matches, cache), matches


def _dfs_weight(reqs: list[Req], matches: dict[int, PrefixMatch],
                cache: BaseCachePolicy) -> list[Req]:
    """Depth-first over the tree of the requests' matched nodes, heaviest child first."""
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, dict[int, Any]] = defaultdict(dict)
    at_node: dict[int, list[Req]] = defaultdict(list)
    roots: dict[int, Any] = {}
    for req in reqs:
        path = cache.ancestors(matches[id(req)])
        roots.setdefault(id(path[0]), path[0])
        for parent, child in zip(path, path[1:]):
            children[id(parent)][id(child)] = child
        for node in path:
            weight[id(node)] += 1
        at_node[id(path[-1])].append(req)
    ordered: list[Req] = []
    stack = sorted(roots.values(), key=lambda n: weight[id(n)])
    while stack:
        node = stack.pop()
        ordered.extend(at_node[id(node)])
        stack.extend(sorted(children[id(node)].values(), key=lambda n: weight[id(n)]))
    return ordered


def defer_for_sharing(req: Req, match: PrefixMatch, admitted: set[tuple[int, ...]]) -> bool:
    """Whether ``req`` should wait a round because a request admitted in this round starts with
    the same :data:`IN_QUEUE_SHARING_TOKENS` tokens and the cache does not have them yet: the
    other computes the prefix once, and ``req`` finds it in the cache next round. Records
    ``req``'s leading tokens in ``admitted`` when it is not deferred."""
    if len(req.input_ids) <= IN_QUEUE_SHARING_TOKENS:
        return False
    head = tuple(req.input_ids[:IN_QUEUE_SHARING_TOKENS])
    if len(match) < IN_QUEUE_SHARING_TOKENS and head in admitted:
        return True
    admitted.add(head)
    return False
