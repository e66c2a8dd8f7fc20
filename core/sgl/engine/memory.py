"""How much memory is free for the KV pool, and how many token slots that buys."""

from __future__ import annotations

import os

import torch

__all__ = ["DEFAULT_CPU_MEM_FRACTION", "DEFAULT_GPU_MEM_FRACTION", "available_memory_bytes",
           "kv_pool_bytes"]

#: ``--mem-fraction-static`` on CPU: the share of the host's available memory (after loading
#: the weights) that the KV pool takes; the rest stays with the system and other processes
DEFAULT_CPU_MEM_FRACTION = 0.1
#: ``--mem-fraction-static`` on a GPU, as SGLang means it: the share of the GPU's total memory
#: the weights and the KV pool take together; the rest holds activations, CUDA graphs and
#: what other processes use
DEFAULT_GPU_MEM_FRACTION = 0.85


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


def kv_pool_bytes(device: torch.device, mem_fraction: float | None) -> int:
    """Bytes the KV pool may take, once the weights are loaded.

    On CUDA, SGLang's rule: the weights and the pool together take ``mem_fraction`` of the
    GPU's total memory, so the pool gets what is free minus the ``1 - mem_fraction`` share
    kept back. Elsewhere ``mem_fraction`` of the available host memory."""
    if device.type == "cuda":
        fraction = DEFAULT_GPU_MEM_FRACTION if mem_fraction is None else mem_fraction
        _check_fraction(fraction)
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - total * (1 - fraction)))
    fraction = DEFAULT_CPU_MEM_FRACTION if mem_fraction is None else mem_fraction
    _check_fraction(fraction)
    return int(available_memory_bytes(device) * fraction)


def _check_fraction(fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {fraction}")
