"""What this CPU runs: the best level of :data:`sgl.kernels.cpu.ISA_LEVELS`, and its vendor."""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

__all__ = ["cpu_vendor", "detect_isa"]


def _cpu_flags() -> dict[str, bool]:
    caps = getattr(torch._C._cpu, "_get_cpu_capability", lambda: {})()
    return {k: bool(caps.get(k)) for k in ("avx2", "fma", "avx512_f", "avx512_bw", "avx512_vl",
                                           "avx512_dq", "avx512_bf16", "amx_bf16", "amx_tile")}


def _amx_permitted() -> bool:
    """Linux keeps AMX tile data off until the process asks for it (arch_prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        return False


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...); empty where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def detect_isa() -> str:
    """The best level this CPU runs (AMX only where the OS grants it)."""
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return "none"
    if not all(flags[k] for k in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")):
        return "avx2" if flags["avx2"] and flags["fma"] else "none"
    if flags["avx512_bf16"] and flags["amx_bf16"] and flags["amx_tile"] and _amx_permitted():
        return "amx"
    return "avx512_bf16" if flags["avx512_bf16"] else "avx512"
