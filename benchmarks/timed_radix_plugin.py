"""A cache policy plugin for benchmarks: sgl's radix cache, timing its own methods.

Loaded with ``sgl.Engine(load_plugins=("benchmarks/timed_radix_plugin.py",),
cache_policy="radix-timed")``; ``get_server_info()["internal_states"][0]["cache_seconds"]`` is
then the time the scheduler spent inside the cache (matching, locking, inserting, evicting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from sgl_cache_radix.radix_cache import RadixCache

from sgl import hookimpl


def _timed(method: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(method)
    def timed(self: TimedRadixCache, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    return timed


class TimedRadixCache(RadixCache):
    name = "radix-timed"
    seconds = 0.0

    match_prefix = _timed(RadixCache.match_prefix)
    lock = _timed(RadixCache.lock)
    unlock = _timed(RadixCache.unlock)
    cache_finished = _timed(RadixCache.cache_finished)
    cache_unfinished = _timed(RadixCache.cache_unfinished)
    evict = _timed(RadixCache.evict)

    def flush(self) -> bool:
        self.seconds = 0.0
        return super().flush()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "cache_seconds": self.seconds}


@hookimpl
def sgl_register_cache_policies(register: Any) -> None:
    register("radix-timed", TimedRadixCache)
