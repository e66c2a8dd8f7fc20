"""How much memory is free for the KV pool, and how many token slots that buys."""

from __future__ import annotations

import os

import torch

__all__ = ["available_memory_bytes", "kv_pool_tokens"]


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV pool will live: device memory for CUDA, else host memory
    (``MemAvailable`` of ``/proc/meminfo``, falling back to ``sysconf``). 0 when unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _host_available_bytes()


def kv_pool_tokens(*, bytes_per_token: int, mem_fraction: float, available_bytes: int,
                   cap_tokens: int) -> int:
    """Token slots that fit in ``mem_fraction`` of ``available_bytes``, at most ``cap_tokens``."""
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    fits = int(available_bytes * mem_fraction) // max(bytes_per_token, 1)
    return min(fits, cap_tokens)
