"""The interface of cache policies (which computed prefixes stay in KV memory), and the policy
the core uses when none is installed or chosen: :class:`NoPrefixCache`.

The scheduler talks to its cache policy at four moments of a request's life:

1. **admission**: :meth:`~BaseCachePolicy.match_prefix` finds the longest cached prefix of the
   request's tokens; the scheduler :meth:`~BaseCachePolicy.lock`\\ s it and writes its slots into
   the request's row of ``req_to_token``, so only the rest is computed;
2. **after a prefill chunk**: :meth:`~BaseCachePolicy.cache_unfinished` takes the computed
   prefix into the cache (so requests admitted next can share it) and hands back the cache's
   slots for it, locked;
3. **finish, abort or retraction**: :meth:`~BaseCachePolicy.cache_finished` takes every slot
   of the request: it keeps what it wants and frees the rest, and drops the request's lock;
4. **memory pressure**: :meth:`~BaseCachePolicy.evict` frees unlocked cached slots.

Slots are the token slots of the one :class:`~sgl.kvcache.pool.KVPool` that running requests
also allocate from: a policy never allocates, it only keeps or frees what requests computed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sgl.kvcache.pool import KVPool

__all__ = ["BaseCachePolicy", "CacheStats", "NoPrefixCache", "PrefixMatch"]

_NO_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass
class PrefixMatch:
    """A cached prefix of some token sequence: its KV slots and the policy's handle on it
    (for :meth:`BaseCachePolicy.lock`; for a radix tree, the node where the match ends)."""

    slots: torch.Tensor = field(default_factory=lambda: _NO_SLOTS)  # [length] int64
    handle: Any = None

    def __len__(self) -> int:
        return int(self.slots.numel())


@dataclass
class CacheStats:
    """Counters a policy keeps for ``/get_server_info`` and metrics."""

    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, tokens found in the cache
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BaseCachePolicy(ABC):
    """Keeps KV of computed sequences for reuse by later requests that share a prefix.

    :param kv_pool: the pool the slots come from and go back to.
    :param page_size: the cache matches and keeps whole pages of this many tokens only.
    """

    name = "base"

    def __init__(self, *, kv_pool: KVPool, page_size: int = 1) -> None:
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.stats = CacheStats()

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` (a whole number of pages); not locked."""

    @abstractmethod
    def lock(self, match: PrefixMatch) -> None:
        """Protect a matched prefix from eviction while a request uses it (counted: each
        lock needs one unlock)."""

    @abstractmethod
    def unlock(self, match: PrefixMatch) -> None:
        """Undo one :meth:`lock`."""

    @abstractmethod
    def cache_finished(self, token_ids: Sequence[int], slots: torch.Tensor,
                       match: PrefixMatch) -> None:
        """Take every slot of a request that holds no more memory: ``slots[i]`` holds the KV of
        ``token_ids[i]``; the first ``len(match)`` are the cache's own (locked by ``match``).
        Keep what is worth keeping, free the rest, unlock ``match``."""

    @abstractmethod
    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor,
                         match: PrefixMatch) -> PrefixMatch:
        """Take the computed prefix of a running request into the cache.

        :return: the new match (locked; ``match`` is unlocked). Its slots replace the first
            ``len(new)`` of the request's slots (duplicates of tokens the cache already had are
            freed); the request keeps ownership of the slots after them.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked cached slots if there are that many, least
        recently used first; return how many were freed."""

    @abstractmethod
    def flush(self) -> bool:
        """Drop everything cached; refused (False) while any prefix is locked."""

    @property
    @abstractmethod
    def cached_tokens(self) -> int:
        """Slots currently held by the cache."""

    @property
    @abstractmethod
    def evictable_tokens(self) -> int:
        """Cached slots no request has locked: free memory on demand."""

    def protect(self, match: PrefixMatch) -> None:
        """Softly protect a prefix (a session's conversation): evicted only after every
        unprotected prefix. Policies without a notion of this ignore it."""

    def unprotect(self, match: PrefixMatch) -> None:
        """Undo one :meth:`protect`."""

    def ancestors(self, match: PrefixMatch) -> list[Any]:
        """Handles from the root to ``match.handle`` (for the dfs-weight schedule policy);
        policies without a tree return ``[match.handle]``."""
        return [match.handle]

    def info(self) -> dict[str, Any]:
        """What ``/get_server_info`` reports about the cache."""
        return {"cache_policy": self.name, "cached_tokens": self.cached_tokens,
                "evictable_tokens": self.evictable_tokens,
                "cache_hit_rate": round(self.stats.hit_rate, 4),
                "cache_hit_tokens": self.stats.hit_tokens,
                "cache_queried_tokens": self.stats.queried_tokens,
                "cache_evicted_tokens": self.stats.evicted_tokens}


class NoPrefixCache(BaseCachePolicy):
    """Caches nothing: every request computes its whole prompt and frees all its slots."""

    name = "none"

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch()

    def lock(self, match: PrefixMatch) -> None:
        pass

    def unlock(self, match: PrefixMatch) -> None:
        pass

    def cache_finished(self, token_ids: Sequence[int], slots: torch.Tensor,
                       match: PrefixMatch) -> None:
        self.kv_pool.free(slots)

    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor,
                         match: PrefixMatch) -> PrefixMatch:
        return match

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> bool:
        return True

    @property
    def cached_tokens(self) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0
