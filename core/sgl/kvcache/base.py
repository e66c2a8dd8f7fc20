"""The interface of cache policies (which finished prefixes stay in KV memory)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from sgl.kvcache.pool import KVPool

__all__ = ["BaseCachePolicy", "PrefixMatch"]


@dataclass
class PrefixMatch:
    """The longest cached prefix of a request: its KV slots and a handle to lock it with."""

    slots: torch.Tensor  # [matched_len] int64
    handle: object = None


class BaseCachePolicy(ABC):
    """Keeps KV of finished sequences for reuse by later requests sharing a prefix.

    Called by the scheduler at admission (:meth:`match_prefix`), when a sequence finishes
    (:meth:`cache_finished`), and under memory pressure (:meth:`evict`). Everything it holds
    lives in the one :class:`KVPool` shared with running requests.
    """

    def __init__(self, *, kv_pool: KVPool, page_size: int) -> None:
        self.kv_pool = kv_pool
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids``."""

    @abstractmethod
    def lock(self, match: PrefixMatch) -> None:
        """Protect a matched prefix from eviction while a request uses it."""

    @abstractmethod
    def unlock(self, match: PrefixMatch) -> None:
        """Undo :meth:`lock`."""

    @abstractmethod
    def cache_finished(self, token_ids: list[int], slots: torch.Tensor) -> None:
        """Take ownership of a finished sequence's slots; free what it does not keep."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked slots if possible; return how many were freed."""

    @abstractmethod
    def flush(self) -> None:
        """Drop everything cached (only when no request holds a lock)."""

    @property
    @abstractmethod
    def num_cached_tokens(self) -> int:
        """Slots currently held by the cache."""
