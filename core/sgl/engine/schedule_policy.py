"""What one scheduler step runs (:class:`ScheduledBatch`), which waiting requests join it
(:class:`Admission`), and the order in which they are considered (``--schedule-policy``).

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

import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sgl.engine.batch_builder import BatchSeq
from sgl.forward_batch import ForwardMode

if TYPE_CHECKING:
    from sgl.engine.sequence import Req
    from sgl.kvcache import BaseCachePolicy, KVPool, PrefixMatch, ReqToTokenPool

__all__ = ["CACHE_AWARE_POLICIES", "CACHE_AWARE_QUEUE_LIMIT", "IN_QUEUE_SHARING_TOKENS",
           "Admission", "ScheduledBatch", "defer_for_sharing", "order_waiting", "shared_len",
           "wait_for_prefix"]

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


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common (slices compare in C; the
    search halves the candidate length)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def wait_for_prefix(req: Req, match: PrefixMatch,
                    in_flight: Sequence[tuple[Sequence[int], int]]) -> bool:
    """Whether ``req`` should wait a step because a prompt being computed in this step shares
    at least :data:`IN_QUEUE_SHARING_TOKENS` more of its leading tokens than the cache holds
    for it now. ``in_flight``: each such prompt's tokens and how many of them will be in the
    cache after this step (its chunks so far). A burst of requests on one system prompt that
    arrives while the first of them is still in its prefill chunks then computes the system
    prompt once, not once per request admitted meanwhile."""
    if len(req.input_ids) <= IN_QUEUE_SHARING_TOKENS:
        return False
    head = req.input_ids[:IN_QUEUE_SHARING_TOKENS]
    for tokens, computed in in_flight:
        if computed - len(match) < IN_QUEUE_SHARING_TOKENS or tokens[:len(head)] != head:
            continue
        gain = min(shared_len(req.input_ids, tokens[:computed]), max_prefix_len(req))
        if gain - len(match) >= IN_QUEUE_SHARING_TOKENS:
            return True
    return False


@dataclass
class ScheduledBatch:
    """One step's work: ``(request, number of new tokens)`` pairs, decodes first, then prompt
    chunks. The forward runs their tokens back to back in this order."""

    items: list[tuple[Req, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def reqs(self) -> list[Req]:
        return [req for req, _ in self.items]

    @property
    def decode_seqs(self) -> int:
        """How many leading requests run one generated token each (a decode step's rows).
        A prompt's last token, even alone after a prefix-cache hit, is a prefill row: prompt
        tokens always take the extend attention and generated ones the decode attention, so a
        request's tokens do not depend on what the cache held."""
        count = 0
        for req, n in self.items:
            if not (n == 1 and req.pending == 1 and not req.draft
                    and req.kv_len >= len(req.input_ids)):
                break
            count += 1
        return count

    @property
    def mode(self) -> ForwardMode:
        decode = self.decode_seqs == len(self.items)
        return ForwardMode.DECODE if decode else ForwardMode.EXTEND

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def offsets(self) -> list[int]:
        """Where each request's tokens start in the forward (and, last, the total)."""
        offsets = [0]
        for _, n in self.items:
            offsets.append(offsets[-1] + n)
        return offsets

    def seqs(self) -> list[BatchSeq]:
        """The sequences of the forward: each request's next ``n`` tokens after its KV (for a
        request with a speculative draft, its last token and the draft)."""
        return [BatchSeq(r.row, r.kv_len, r.token_slice(r.kv_len, r.kv_len + n - len(r.draft))
                         + r.draft, tree_parents=None if r.draft_parents is None
                         else [-1] + [p + 1 for p in r.draft_parents])
                if r.draft else BatchSeq(r.row, r.kv_len, r.token_slice(r.kv_len, r.kv_len + n))
                for r, n in self.items]


def max_prefix_len(req: Req) -> int:
    """How many leading tokens of ``req`` may come from the cache: all but the last (whose
    logits are needed), and none of the prompt positions whose logprobs were asked for."""
    limit = req.seq_len - 1
    if req.logprobs.return_logprob and req.next_input_logprob < len(req.input_ids):
        limit = min(limit, max(req.next_input_logprob - 1, 0))
    return max(limit, 0)


class Admission:
    """Which waiting requests join the running batch: in the schedule policy's order, each
    from its longest cached prefix (locked for it), while the token budget, the KV memory
    they will need, the free request rows and ``--max-running-requests`` allow."""

    def __init__(self, policy: str, cache: BaseCachePolicy, kv_pool: KVPool,
                 req_to_token_pool: ReqToTokenPool, max_running_requests: int,
                 context_length: int) -> None:
        self.policy = policy
        #: no sequence grows past this: the context, or the whole KV pool if smaller
        self.max_seq_len = min(context_length, kv_pool.size)
        self.cache = cache
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.max_running_requests = max_running_requests
        #: the most output tokens a request runs here (1 on a prefill server, which hands
        #: requests over after their first token); None: their max_new_tokens
        self.max_output: int | None = None

    def expected_output(self, req: Req, new_token_ratio: float) -> int:
        """KV slots to keep for the rest of ``req``'s output: a share ``new_token_ratio`` of
        the new tokens it may still generate, and never more than can fit (a ``max_new_tokens``
        of 2**31 must not hold up every other request)."""
        room = max(self.max_seq_len - req.seq_len, 0)
        if self.max_output is not None:
            room = min(room, max(self.max_output - len(req.output_ids), 0))
        return math.ceil(min(req.remaining_new_tokens(), room) * new_token_ratio)

    def kv_available(self) -> int:
        """KV slots free now or freeable by evicting unlocked cached prefixes."""
        return self.kv_pool.num_free + self.cache.evictable_tokens

    def has_room(self, waiting: Sequence[Req], num_running: int, budget: int) -> bool:
        return bool(waiting and budget > 0 and self.req_to_token_pool.num_free > 0
                    and num_running < self.max_running_requests)

    def select(self, waiting: Sequence[Req], num_running: int, budget: int, free: int,
               reserved: int, new_token_ratio: float,
               in_flight: Sequence[tuple[Req, int]] = ()) -> list[tuple[Req, PrefixMatch, int]]:
        """``(request, its locked cached prefix, new tokens it runs this step)`` for each
        request to admit. ``free``: KV slots this step's tokens may still take; ``reserved``:
        slots the running requests are expected to need for their outputs (a share
        ``new_token_ratio`` of what they may still generate); a request is admitted only if
        its prompt and its expected output fit beside them (or it would run alone).
        ``in_flight``: the running requests whose prompts have a chunk in this step, with its
        tokens (see :func:`wait_for_prefix`)."""
        order, matches = order_waiting(self.policy, waiting, self.cache, max_prefix_len)
        shared_heads: set[tuple[int, ...]] = set()
        prompts = [(r.input_ids, min(r.kv_len + n, len(r.input_ids))) for r, n in in_flight]
        rows_free = self.req_to_token_pool.num_free
        chosen: list[tuple[Req, PrefixMatch, int]] = []
        for req in order:
            running = num_running + len(chosen)
            if not (budget > 0 and rows_free > len(chosen)
                    and running < self.max_running_requests):
                break
            match = matches.get(id(req))  # an empty match is falsy: test for None
            if match is None:
                match = self.cache.match_prefix(req.token_slice(0, max_prefix_len(req)))
            if self.policy in CACHE_AWARE_POLICIES and (
                    wait_for_prefix(req, match, prompts)
                    or defer_for_sharing(req, match, shared_heads)):
                continue
            self.cache.lock(match)
            pending = req.seq_len - len(match)
            need = pending + self.expected_output(req, new_token_ratio)
            available = self.kv_available()
            if (need > available - reserved and running) or pending > available:
                self.cache.unlock(match)  # wait for memory to come back
                break
            n = min(pending, budget, free)
            chosen.append((req, match, max(n, 0)))
            prompts.append((req.input_ids, min(len(match) + max(n, 0), len(req.input_ids))))
            if n > 0:
                budget, free = budget - n, free - n
            reserved += need
        return chosen
