"""KV memory and cache policies."""

from __future__ import annotations

from sgl.kvcache.base import BaseCachePolicy, CacheStats, NoPrefixCache, PrefixMatch
from sgl.kvcache.pool import KVPool, OutOfSlotsError, ReqToTokenPool

__all__ = ["BaseCachePolicy", "CacheStats", "KVPool", "NoPrefixCache", "OutOfSlotsError",
           "PrefixMatch", "ReqToTokenPool"]
