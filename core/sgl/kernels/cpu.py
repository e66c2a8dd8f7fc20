"""sgl's CPU kernels: which instruction-set level runs, and typed calls of the kernel operators.

The kernels themselves are a plugin (``plugins/kernels/sgl-kernels-cpu``, compiled when it is
installed) that implements the ``torch.ops.sgl`` operators of :mod:`sgl.kernels.ops` for CPU
tensors: bfloat16 matmuls (on AMX tiles, with AVX512-BF16 dot products, or widened to float32 on
AVX-512 or AVX2), a float32 matmul, paged decode and extend attention for float32/bfloat16 KV,
fused add + RMSNorm, SiLU x up, rotary, embedding and argmax. What runs is decided once, by one ladder of
instruction-set levels (:data:`ISA_LEVELS`, best first):

* ``amx``: the bfloat16 matmul on AMX tiles (Intel Sapphire Rapids and later), the rest as below;
* ``avx512_bf16``: the attention's bfloat16 q.k with ``vdpbf16ps`` (AMD Zen 4/5, Intel where
  AMX is missing or hidden), and the bfloat16 matmul too on AMD (on Intel the widened one below
  is faster: :attr:`CpuKernels.bf16_dot_matmul`);
* ``avx512``: every kernel, the bfloat16 matmul's products widened to float32 FMAs;
* ``avx2``: every kernel on AVX2 + FMA (8-lane vectors; Intel before AVX-512, AMD Zen 1-3);
* ``none``: torch's operators.

The level is the best this CPU has, capped by ``SGL_CPU_ISA`` (one of the levels; ``sgl serve
--cpu-isa`` sets it for the server) and by ``SGL_CPU_KERNELS=0`` (``none``); :func:`set_isa`
changes it in a running process (tests run every level the CPU has this way). Without the plugin
(not installed, built without its compiled part, ``--disable-plugin kernels-cpu``), or at
``none``, :func:`load` returns None and the layers run their torch code.

The matmuls are used only when torch runs on one thread (with more, torch's OpenMP threads and
the kernel's would fight over the cores). They split their output columns over
:func:`set_threads` threads of their own: helpers that claim chunks from one atomic counter, so a
helper the OS delays costs only the chunk it holds, and that sleep after 200 us idle. The decode
attention shares a batch's sequences over the same threads, the norm, SiLU x up and rotary
kernels their rows (8 or more per chunk); embedding and argmax are single-threaded. See
``docs/kernels.md`` and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.kernels import ops  # noqa: F401  (declares the torch.ops.sgl operators)
from sgl.kernels.library import KernelLibrary, KernelLibraryUnavailable, KernelTape
from sgl.kernels.ops import pack_bf16_weight, pack_f32_weight

if TYPE_CHECKING:
    from sgl.plugins import SglPluginManager

__all__ = ["DTYPES", "ISA_LEVELS", "KERNEL_LEVELS", "CpuKernels", "argmax_rows", "cpu_isa",
           "cpu_vendor", "describe_isa", "detected_isa", "effective_isa", "fits",
           "isa_at_least", "kernel_threads", "load", "pack_bf16_weight", "pack_f32_weight",
           "recording", "requested_isa", "set_isa", "set_threads", "use_plugins"]

logger = logging.getLogger(__name__)

#: the instruction-set levels of the kernels, best first; a CPU runs its own and all below it
ISA_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2", "none")
#: the levels at which sgl's kernels run (below them, torch's operators do everything)
KERNEL_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2")
#: tensor dtypes the kernels take
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.RLock()
_loaded: CpuKernels | None = None
_tried = False
_threads = 1
_isa_cap: str | None = None  # set_isa's level; None: SGL_CPU_ISA / SGL_CPU_KERNELS decide
_plugins: SglPluginManager | None = None  # use_plugins'; None: the installed plugins
_library: KernelLibrary | None = None  # the plugin's library, whatever the level
_library_tried = False
_library_missing = ""  # why there is no library, for describe_isa

_sgl = torch.ops.sgl


@dataclass(frozen=True)
class CpuKernels:
    """The kernel library at one level of :data:`KERNEL_LEVELS`, and typed calls of its
    operators (``torch.ops.sgl``; the layers check shapes with :func:`fits` first)."""

    library: KernelLibrary
    isa: str

    @functools.cached_property
    def amx(self) -> bool:
        """The bfloat16 matmul on AMX tiles."""
        return self.isa == "amx"

    @functools.cached_property
    def avx512_bf16(self) -> bool:
        """bfloat16 dot products (``vdpbf16ps``) in the matmul and the decode attention."""
        return self.isa in ("amx", "avx512_bf16")

    @functools.cached_property
    def bf16_dot_matmul(self) -> bool:
        """Whether the bfloat16 matmul without AMX uses ``vdpbf16ps`` rather than widening to
        fp32 FMAs: on AMD only. On Intel (Sapphire Rapids with AMX capped, 2 cores) the widened
        kernel measured 1.65x the dot-product one at 32 rows (134 vs 81 GFLOP/s on one thread)
        and equal at 1 row; on Zen 4 ``vdpbf16ps`` does twice the products of an FMA at the same
        rate (not measured here)."""
        return self.isa == "avx512_bf16" and cpu_vendor() == "AuthenticAMD"

    @staticmethod
    def linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K]`` (bfloat16) times the :func:`pack_bf16_weight` copy of ``W [n, K]``;
        ``bias`` float32 ``[n]`` or None. Returns ``[M, n]`` bfloat16."""
        return _sgl.linear_bf16(x, packed, n, bias)

    @staticmethod
    def linear_f32(x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K]`` (float32) times the :func:`pack_f32_weight` copy of ``W [n, K]``."""
        return _sgl.linear_f32(x, packed, n, bias)

    @staticmethod
    def rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` (without residual: ``(norm(x), x)``), with
        transformers' rounding order."""
        if residual is None:
            return _sgl.rmsnorm(x, weight, eps), x
        return _sgl.add_rmsnorm(x, residual, weight, eps)

    @staticmethod
    def rmsnorm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      head_dim: int) -> torch.Tensor:
        """RMSNorm of every ``head_dim``-wide part of the rows of ``x``."""
        return _sgl.rmsnorm_heads(x, weight, eps, head_dim)

    @staticmethod
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :d]) * x[:, d:]`` for ``x [T, 2d]``."""
        return _sgl.silu_mul(x)

    @staticmethod
    def rotary(x: torch.Tensor, heads: int, head_dim: int, rotary_dim: int,
               cos_sin: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate-half rotary of ``x [T, heads * head_dim]`` (see ``sgl::rotary``)."""
        return _sgl.rotary(x, heads, head_dim, rotary_dim, cos_sin, positions)

    @staticmethod
    def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]``; IndexError for an id outside the table."""
        return _sgl.embedding(weight, ids)

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` for float32 ``[B, V]`` rows (first maximum)."""
        return _sgl.argmax(logits)

    def extend_attention_faster(self, dtype: torch.dtype) -> bool:
        """Whether ``sgl::extend_attention`` beats torch's SDPA on one thread for ``dtype``. One
        layer of a 1024-token SmolLM2 prefill (9 heads, 3 KV heads, 64 wide; 2-core Sapphire
        Rapids, ms, kernel on 1 / 2 threads vs SDPA on 1): float32 19.8 / 11.6 vs 24.4;
        bfloat16 at ``amx`` 19.1 / 11.3 vs 10.5 (SDPA's bfloat16 runs on AMX tiles), at
        ``avx512_bf16`` 19.4 / 10.4 vs 14.3 (oneDNN capped likewise), at ``avx512`` 29.6 / 12.1
        vs 19.0; at ``avx2`` (torch capped alike: ``ATEN_CPU_CAPABILITY=avx2``,
        ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``; two runs) float32
        40-53 / 24-31 vs 32-36, bfloat16 46-53 / 23-30 vs 40-41
        (``benchmarks/extend_attention.py``). The kernel computes in float32 at every level."""
        if self.isa == "avx2":  # 8 lanes: ahead of SDPA only on two or more threads
            return dtype in DTYPES and kernel_threads() >= 2
        if dtype == torch.float32:
            return True
        return dtype == torch.bfloat16 and not self.amx and kernel_threads() >= 2

    @staticmethod
    def decode_attention_fits(num_heads: int, num_kv_heads: int, head_dim: int,
                              v_dim: int) -> bool:
        """Whether ``sgl::decode_attention``'s kernel takes heads of this shape."""
        return (num_kv_heads >= 1 and num_heads % num_kv_heads == 0 and num_heads <= 256
                and all(d % 16 == 0 and 16 <= d <= 256 for d in (head_dim, v_dim)))


def fits(*tensors: torch.Tensor | None) -> bool:
    """Whether the elementwise kernels take these tensors: on CPU, 2-D, one dtype of
    :data:`DTYPES`, unit stride in the last dimension, no autograd (None entries are skipped)."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if (t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1 or t.requires_grad
                or t.dtype not in DTYPES or (dtype is not None and t.dtype != dtype)):
            return False
        dtype = t.dtype
    return True


@contextlib.contextmanager
def recording() -> Iterator[KernelTape]:
    """Record the kernel calls this thread makes inside the block; the tape is filled when the
    block ends (empty without the kernels)."""
    tape = KernelTape()
    kernels = load()
    if kernels is None:
        yield tape
        return
    kernels.library.record_begin()
    try:
        yield tape
    finally:
        recorded = kernels.library.record_end()
        tape.library, tape.calls, tape.count = recorded.library, recorded.calls, recorded.count
        tape.inputs, tape.outputs = recorded.inputs, recorded.outputs


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
def detected_isa() -> str:
    """The best level of :data:`ISA_LEVELS` this CPU runs (AMX only where the OS grants it)."""
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return "none"
    if not all(flags[k] for k in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")):
        return "avx2" if flags["avx2"] and flags["fma"] else "none"
    if flags["avx512_bf16"] and flags["amx_bf16"] and flags["amx_tile"] and _amx_permitted():
        return "amx"
    return "avx512_bf16" if flags["avx512_bf16"] else "avx512"


def _check_level(level: str, where: str) -> str:
    level = level.strip().lower()
    if level != "auto" and level not in ISA_LEVELS:
        raise ValueError(f"{where}={level!r}: expected auto or one of {', '.join(ISA_LEVELS)}")
    return level


def requested_isa() -> str:
    """The cap on the level: :func:`set_isa`'s, else ``SGL_CPU_ISA`` (``none`` with
    ``SGL_CPU_KERNELS=0``); ``auto`` for no cap. ValueError for a name not in the ladder."""
    if _isa_cap is not None:
        return _isa_cap
    if os.environ.get("SGL_CPU_KERNELS", "1") == "0":
        return "none"
    return _check_level(os.environ.get("SGL_CPU_ISA", "") or "auto", "SGL_CPU_ISA")


def isa_at_least(level: str, floor: str) -> bool:
    """Whether ``level`` includes ``floor`` (both names of :data:`ISA_LEVELS`)."""
    return ISA_LEVELS.index(level) <= ISA_LEVELS.index(floor)


def effective_isa(requested: str) -> str:
    """The level that runs for the cap ``requested`` (see :func:`requested_isa`) on this CPU."""
    detected = detected_isa()
    if requested == "auto" or isa_at_least(requested, detected):
        return detected  # never above what the CPU has
    return requested


def cpu_isa() -> str:
    """The level the CPU kernels run at now: the CPU's best, capped (see
    :func:`requested_isa`); ``none`` where a kernel level was due but there is no kernel
    library (see :func:`describe_isa`)."""
    kernels = load()
    if kernels is not None:
        return kernels.isa
    level = effective_isa(requested_isa())
    return "none" if level in KERNEL_LEVELS else level


def describe_isa() -> str:
    """One line for logs and ``sgl plugins``: the level in use and why."""
    level, detected = cpu_isa(), detected_isa()
    capped = effective_isa(requested_isa())
    parts = [f"CPU has {detected}"]
    if capped != detected:
        parts.append(f"capped at {capped}")
    if level == "none" and capped in KERNEL_LEVELS:
        parts.append(_library_missing or "no kernel library")
    elif level not in KERNEL_LEVELS:
        parts.append("torch operators only")
    else:
        parts.append(_library.describe() if _library is not None else "")
    return f"{level} ({', '.join(p for p in parts if p)})"


def set_isa(level: str) -> str:
    """Run the kernels at ``level`` (a name of :data:`ISA_LEVELS`, or ``auto``: the CPU's best
    or ``SGL_CPU_ISA``'s) from now on, never above what the CPU has; returns the level in use
    (:func:`cpu_isa`). Weights packed before keep the layout of their level."""
    global _isa_cap, _tried, _loaded
    level = _check_level(level, "cpu isa")
    with _lock:
        _isa_cap = None if level == "auto" else level
        _tried, _loaded = False, None
    return cpu_isa()


def use_plugins(plugin_manager: SglPluginManager | None) -> None:
    """Take the CPU kernel library from ``plugin_manager``'s registries (the plugins this
    process loaded: ``--disable-plugin kernels-cpu`` leaves the kernels out); None: from the
    installed plugins, found on first use."""
    global _plugins, _library, _library_tried, _library_missing, _tried, _loaded
    with _lock:
        _plugins = plugin_manager
        _library, _library_tried, _library_missing = None, False, ""
        _tried, _loaded = False, None


def _find_library() -> KernelLibrary | None:
    """The registered ``cpu`` kernel library, built on the first call; None (with the reason in
    ``_library_missing``) where there is none or it cannot run here."""
    global _library, _library_tried, _library_missing
    if _library_tried:
        return _library
    _library_tried = True
    pm = _plugins
    if pm is None:
        from sgl.plugins import create_plugin_manager

        pm = create_plugin_manager()
    try:
        registry = pm.registries.kernels
    except RuntimeError as exc:  # plugins that clash (reported where the registries are used)
        _library_missing = f"no kernel library: {exc}"
        return None
    if "cpu" not in registry.names():
        _library_missing = ("no CPU kernel library: install sgl-kernels-cpu "
                            "(plugins/kernels/sgl-kernels-cpu)")
        if "kernels-cpu" in pm.records and not pm.records["kernels-cpu"].available:
            _library_missing += f"; it is unavailable: {pm.records['kernels-cpu'].reason}"
        return None
    entry = registry.entry("cpu")
    try:
        library = entry.load()()
    except KernelLibraryUnavailable as exc:
        _library_missing = str(exc)
        logger.warning("sgl's CPU kernels are off, torch runs everything (slower): %s", exc)
        return None
    except Exception as exc:  # a broken plugin must not stop the server: torch runs instead
        _library_missing = f"plugin {entry.owner!r} failed: {type(exc).__name__}: {exc}"
        logger.warning("sgl's CPU kernels are off: %s", _library_missing)
        return None
    _library = library
    return library


def load() -> CpuKernels | None:
    """The kernels at this process's level (see :func:`cpu_isa`); None where they cannot be used
    (the level ``none``, no kernel library, another architecture)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        level = effective_isa(requested_isa())
        library = _find_library() if level in KERNEL_LEVELS else None
        if library is not None and level not in library.levels:
            library = None
        _loaded = None
        if library is not None:
            kernels = CpuKernels(library=library, isa=level)
            library.set_level(level, kernels.bf16_dot_matmul)
            _loaded = kernels
        _tried = True
        return _loaded


def set_threads(threads: int) -> int:
    """Use ``threads`` threads (the caller included) in the kernels from now on; returns the
    number in use (1 without the kernels)."""
    global _threads
    kernels = load()
    if kernels is None:
        return 1
    with _lock:
        _threads = int(kernels.library.set_threads(max(1, int(threads))))
    return _threads


def kernel_threads() -> int:
    """Threads of the kernels (see :func:`set_threads`)."""
    return _threads


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[B, V]`` logits (first maximum), through the kernel for CPU
    float32 rows: torch's CPU argmax over a 49k vocabulary takes 0.2-0.3 ms per row, the kernel
    a tenth of that."""
    kernels = load() if logits.device.type == "cpu" else None
    if (kernels is not None and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.stride(1) == 1 and not logits.requires_grad and logits.shape[1] > 0):
        return kernels.argmax(logits)
    return logits.max(dim=-1).indices  # the same index as argmax, and 3-9x faster on CPU
