"""What this CPU runs: the best of :attr:`CpuKernelLibrary.levels <sgl_kernels_cpu.library.CpuKernelLibrary.levels>`, and its vendor."""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

__all__ = ["cpu_vendor", "detect_isa", "has_feature"]


#: the features the levels need: each one's key in torch's ``_get_cpu_capability()`` (those
#: tried in turn: torch 2.x names FMA ``fma3``, beside AMD's ``fma4``) and its flag in
#: /proc/cpuinfo
_FEATURES = {"avx2": (("avx2",), "avx2"), "fma": (("fma3", "fma"), "fma"),
             "f16c": (("f16c",), "f16c"),
             "avx512_f": (("avx512_f",), "avx512f"), "avx512_bw": (("avx512_bw",), "avx512bw"),
             "avx512_vl": (("avx512_vl",), "avx512vl"), "avx512_dq": (("avx512_dq",), "avx512dq"),
             "avx512_bf16": (("avx512_bf16",), "avx512_bf16"),
             "avx512_vnni": (("avx512_vnni",), "avx512_vnni"),
             "amx_bf16": (("amx_bf16",), "amx_bf16"), "amx_tile": (("amx_tile",), "amx_tile"),
             "amx_int8": (("amx_int8",), "amx_int8")}


def _torch_capability() -> dict:
    """torch's view of the CPU (cpuinfo's, the OS's support included); empty where this torch
    has no ``_get_cpu_capability``."""
    return getattr(torch._C._cpu, "_get_cpu_capability", lambda: {})()


def _proc_cpu_flags() -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (Linux's, the OS's support included);
    empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_flags() -> dict[str, bool]:
    """Each feature of :data:`_FEATURES`: torch's answer where torch has the key, else
    /proc/cpuinfo's (read only when needed)."""
    caps, proc = _torch_capability(), None
    flags: dict[str, bool] = {}
    for feature, (keys, proc_flag) in _FEATURES.items():
        key = next((k for k in keys if k in caps), None)
        if key is not None:
            flags[feature] = bool(caps[key])
        else:
            if proc is None:
                proc = _proc_cpu_flags()
            flags[feature] = proc_flag in proc
    return flags


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
def has_feature(feature: str) -> bool:
    """Whether the CPU has ``feature`` (a key of :data:`_FEATURES`, e.g. ``avx512_vnni``)."""
    return _cpu_flags()[feature]


@functools.cache
def detect_isa() -> str:
    """The best level this CPU runs (AMX only where the OS grants it)."""
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return "none"
    if not all(flags[k] for k in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")):
        return "avx2" if flags["avx2"] and flags["fma"] and flags["f16c"] else "none"
    amx = flags["amx_bf16"] and flags["amx_int8"] and flags["amx_tile"]
    if flags["avx512_bf16"] and amx and _amx_permitted():
        return "amx"
    return "avx512_bf16" if flags["avx512_bf16"] else "avx512"
