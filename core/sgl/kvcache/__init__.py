"""KV memory and cache policies."""

from __future__ import annotations

from sgl.kvcache.base import BaseCachePolicy
from sgl.kvcache.pool import KVPool, OutOfSlotsError, ReqToTokenPool

__all__ = ["BaseCachePolicy", "KVPool", "OutOfSlotsError", "ReqToTokenPool"]
