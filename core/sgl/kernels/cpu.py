"""CPU kernels for the decode hot path, compiled on first use and called through ctypes.

``csrc/cpu_kernels.c`` holds bfloat16 matmuls (on AMX tiles, with AVX512-BF16 dot products, or
widened to float32 on AVX-512), a float32 matmul, a paged decode attention for float32/bfloat16
KV, fused add + RMSNorm, SiLU x up, rotary, embedding and argmax. Each function picks its
instruction set with a target attribute, so the library builds for any x86-64 CPU; what runs is
decided once, by one ladder of instruction-set levels (:data:`ISA_LEVELS`, best first):

* ``amx``: the bfloat16 matmul on AMX tiles (Intel Sapphire Rapids and later), the rest as below;
* ``avx512_bf16``: the attention's bfloat16 q.k with ``vdpbf16ps`` (AMD Zen 4/5, Intel where
  AMX is missing or hidden), and the bfloat16 matmul too on AMD (on Intel the widened one below
  is faster: :attr:`CpuKernels.bf16_dot_matmul`);
* ``avx512``: every kernel, the bfloat16 matmul's products widened to float32 FMAs;
* ``avx2``: no kernels of sgl's yet: torch's operators (MKL, oneDNN) run everything;
* ``none``: torch's operators.

The level is the best this CPU has, capped by ``SGL_CPU_ISA`` (one of the levels; ``sgl serve
--cpu-isa`` sets it for the server) and by ``SGL_CPU_KERNELS=0`` (``none``); :func:`set_isa`
changes it in a running process (tests run every level the CPU has this way). On the first use
this module compiles the library with the system C compiler (``$CC``, else ``cc``/``gcc``/
``clang``; about a second) into ``$SGL_CACHE_DIR/kernels`` (default ``~/.cache/sgl/kernels``),
keyed by the source, the compiler and the flags, and loads it. Without a compiler or AVX-512, or
on another architecture, :func:`load` returns None and callers keep their torch code.

The matmuls are used only when torch runs on one thread (with more, torch's OpenMP threads and
the kernel's would fight over the cores). They split their output columns over
:func:`set_threads` threads of their own: helpers that claim chunks from one atomic counter, so a
helper the OS delays costs only the chunk it holds, and that sleep after 200 us idle. The decode
attention shares a batch's sequences over the same threads, the norm, SiLU x up and rotary
kernels their rows (8 or more per chunk); embedding and argmax are single-threaded. See
``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DTYPES", "ISA_LEVELS", "KERNEL_LEVELS", "CpuKernels", "KernelTape", "argmax_rows",
           "cpu_isa", "cpu_vendor", "describe_isa", "detected_isa", "effective_isa", "fits",
           "isa_at_least", "kernel_threads", "load", "pack_amx_weight", "recording",
           "requested_isa", "run", "set_isa", "set_threads"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# -ffp-contract=off: a * b + c stays two roundings, as in torch
_FLAGS = ["-O2", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off"]
_lock = threading.Lock()
_loaded: CpuKernels | None = None
_tried = False
_threads = 1
_lib: ctypes.CDLL | None = None  # the built library, whatever the level
_lib_tried = False
_isa_cap: str | None = None  # set_isa's level; None: SGL_CPU_ISA / SGL_CPU_KERNELS decide

#: the instruction-set levels of the kernels, best first; a CPU runs its own and all below it
ISA_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2", "none")
#: the levels at which sgl's kernels run (below them, torch's operators do everything)
KERNEL_LEVELS = ("amx", "avx512_bf16", "avx512")

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library and the level of :data:`KERNEL_LEVELS` it runs at."""

    lib: ctypes.CDLL
    isa: str

    @functools.cached_property
    def amx(self) -> bool:
        """The bfloat16 matmul on AMX tiles."""
        return self.isa == "amx"

    @functools.cached_property
    def avx512_bf16(self) -> bool:
        """bfloat16 dot products (``vdpbf16ps``) in the matmul and the decode attention."""
        return self.isa in ("amx", "avx512_bf16")

    @property
    def avx512(self) -> bool:
        """The AVX-512 kernels (all of them run at every level of :data:`KERNEL_LEVELS`)."""
        return True

    @functools.cached_property
    def bf16_dot_matmul(self) -> bool:
        """Whether the bfloat16 matmul without AMX uses ``vdpbf16ps`` rather than widening to
        fp32 FMAs: on AMD only. On Intel (Sapphire Rapids with AMX capped, 2 cores) the widened
        kernel measured 1.65x the dot-product one at 32 rows (134 vs 81 GFLOP/s on one thread)
        and equal at 1 row; on Zen 4 ``vdpbf16ps`` does twice the products of an FMA at the same
        rate (not measured here)."""
        return self.isa == "avx512_bf16" and cpu_vendor() == "AuthenticAMD"

    def linear_bf16(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K]`` (bfloat16, unit stride in K) times the :func:`pack_amx_weight` copy of
        ``W [n, K]``; ``bias`` float32 ``[n]`` or None. Returns ``[M, n]`` bfloat16. On AMX
        tiles at level ``amx``, else on AVX-512 vectors (with ``vdpbf16ps`` where the level
        has it and :attr:`bf16_dot_matmul` says so)."""
        m, k = x.shape
        y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        b = None if bias is None else bias.data_ptr()
        if self.amx:
            rc = run(self.lib.sgl_linear_bf16_amx,
                     (x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), n, m, n, k, b),
                     x, packed, y, bias)
        else:
            rc = run(self.lib.sgl_linear_bf16_avx512,
                     (x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), n, m, n, k, b,
                      int(self.bf16_dot_matmul)), x, packed, y, bias)
        if rc:
            raise MemoryError(f"the bfloat16 matmul kernel found no memory for its input ({rc})")
        return y

    def linear_f32(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K]`` (float32, unit stride in K) times the :func:`pack_f32_weight` copy of
        ``W [n, K]``; ``bias`` float32 ``[n]`` or None. Returns ``[M, n]`` float32."""
        m, k = x.shape
        y = torch.empty((m, n), dtype=torch.float32, device=x.device)
        run(self.lib.sgl_linear_f32, (x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(),
                                      n, m, n, k, None if bias is None else bias.data_ptr()),
            x, packed, y, bias)
        return y

    # The methods below take 2-D tensors of one dtype in DTYPES whose last dimension has unit
    # stride; callers check that (see :func:`fits`).

    def rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` (without residual: ``(norm(x), x)``), with
        transformers' rounding order; see ``sgl_rmsnorm``."""
        t, h = x.shape
        out = torch.empty((t, h), dtype=x.dtype)
        summed = x if residual is None else torch.empty((t, h), dtype=x.dtype)
        rc = run(self.lib.sgl_rmsnorm, (x.data_ptr(), x.stride(0),
                                        None if residual is None else residual.data_ptr(),
                                        0 if residual is None else residual.stride(0),
                                        None if residual is None else summed.data_ptr(), h,
                                        weight.data_ptr(), out.data_ptr(), h, t, h, 1, eps,
                                        DTYPES[x.dtype]), x, residual, summed, weight, out)
        _check_rmsnorm(rc)
        return out, summed

    def rmsnorm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      head_dim: int) -> torch.Tensor:
        """RMSNorm of every ``head_dim``-wide part of the rows of ``x [T, heads * head_dim]``
        (a row-strided view is fine: q or k split from a fused qkv output) with ``weight
        [1, head_dim]``; returns a new contiguous ``[T, heads * head_dim]``."""
        t, width = x.shape
        heads = width // head_dim
        out = torch.empty((t, width), dtype=x.dtype)
        rc = run(self.lib.sgl_rmsnorm, (x.data_ptr(), x.stride(0), None, 0, None, 0,
                                        weight.data_ptr(), out.data_ptr(), head_dim, t * heads,
                                        head_dim, heads, eps, DTYPES[x.dtype]), x, weight, out)
        _check_rmsnorm(rc)
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :d]) * x[:, d:]`` for ``x [T, 2d]``."""
        t, d = x.shape[0], x.shape[1] // 2
        out = torch.empty((t, d), dtype=x.dtype)
        run(self.lib.sgl_silu_mul, (x.data_ptr(), x.stride(0), out.data_ptr(), d, t, d,
                                    DTYPES[x.dtype]), x, out)
        return out

    def rotary(self, x: torch.Tensor, heads: int, head_dim: int, rotary_dim: int,
               cos_sin: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate-half rotary of ``x [T, heads * head_dim]`` (a row-strided view is fine) with
        rows ``cos_sin [R, 2 * rotary_dim]`` (``cos | cos`` then ``-sin | sin``, in ``x``'s
        dtype): token t uses row ``positions[t]`` (contiguous int64), or row t without
        ``positions``. Returns a new contiguous tensor."""
        t = x.shape[0]
        out = torch.empty((t, heads * head_dim), dtype=x.dtype)
        rc = run(self.lib.sgl_rotary,
                 (x.data_ptr(), x.stride(0), cos_sin.data_ptr(), cos_sin.stride(0),
                  None if positions is None else positions.data_ptr(), cos_sin.shape[0],
                  out.data_ptr(), t, heads, head_dim, rotary_dim, DTYPES[x.dtype]),
                 x, cos_sin, positions, out)
        if rc == -2:
            raise IndexError(f"sgl_rotary: a position outside the {cos_sin.shape[0]} rows of "
                             "the rotary table")
        if rc:
            raise ValueError(f"sgl_rotary: rotary_dim {rotary_dim} for head_dim {head_dim}")
        return out

    def embedding(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]`` for a 2-D ``weight`` with unit stride in its rows and contiguous int64
        ``ids [T]``; IndexError for an id outside the table."""
        t, h = ids.shape[0], weight.shape[1]
        out = torch.empty((t, h), dtype=weight.dtype)
        rc = run(self.lib.sgl_embedding, (weight.data_ptr(), weight.stride(0), weight.shape[0],
                                          ids.data_ptr(), t, out.data_ptr(), h, h,
                                          weight.element_size()), weight, ids, out)
        if rc:
            raise IndexError(f"token id outside the embedding table of {weight.shape[0]} rows")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` for float32 ``[B, V]`` rows (first maximum; NaN wins)."""
        b, v = logits.shape
        out = torch.empty(b, dtype=torch.int64)
        run(self.lib.sgl_argmax_f32, (logits.data_ptr(), logits.stride(0), b, v, out.data_ptr()),
            logits, out)
        return out


def _check_rmsnorm(rc: int) -> None:
    if rc == -2:
        raise MemoryError("sgl_rmsnorm: no memory for its row buffer")
    if rc:
        raise ValueError(f"sgl_rmsnorm refused its arguments ({rc})")


#: tensor dtype -> the kernels' dtype code
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


#: the functions ``sgl_replay`` runs, by name -> its op kind (csrc/cpu_kernels.c, "replay")
_OP_KINDS = {"sgl_linear_bf16_amx": 1, "sgl_linear_f32": 2, "sgl_rmsnorm": 3, "sgl_silu_mul": 4,
             "sgl_rotary": 5, "sgl_embedding": 6, "sgl_decode_attention": 7, "sgl_argmax_f32": 8,
             "sgl_linear_bf16_avx512": 9}
_OP_ARGS = 26


class _Op(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("a", ctypes.c_int64 * _OP_ARGS)]


def _as_int64(value: Any) -> int:
    """An argument as ``sgl_replay`` takes it: None -> 0, a float -> its float32 bits."""
    if value is None:
        return 0
    if isinstance(value, float):
        return int.from_bytes(struct.pack("<f", value), "little")
    return int(value)


class KernelTape:
    """The kernel calls one thread made while :func:`recording`: each function with its exact
    arguments (pointers included), and every tensor those pointers lie in, kept alive so that
    the memory is not handed to anything else. :meth:`replay` runs the calls again on whatever
    those tensors hold now (see :mod:`sgl.engine.cpu_graph`), in one call of ``sgl_replay``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []
        self.tensors: list[torch.Tensor] = []
        self._ops: Any = None  # the calls as sgl_replay's array, built on the first replay

    def _compile(self) -> Any:
        ops = (_Op * len(self.calls))()
        for op, (fn, args) in zip(ops, self.calls):
            kind = _OP_KINDS.get(getattr(fn, "__name__", ""))
            if kind is None or len(args) > _OP_ARGS:
                return False  # not one sgl_replay knows: call them one by one
            op.kind = kind
            for i, value in enumerate(args):
                op.a[i] = _as_int64(value)
        return ops

    def replay(self) -> None:
        """Run the recorded calls in order; RuntimeError naming the first that fails."""
        kernels = load()
        if self._ops is None:
            self._ops = self._compile() if kernels is not None else False
        if self._ops is not False and kernels is not None:
            failed = kernels.lib.sgl_replay(self._ops, len(self.calls))
            if failed:
                fn = self.calls[failed - 1][0]
                raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on replay")
            return
        for fn, args in self.calls:
            if fn(*args):
                raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on replay")


class _Recording(threading.local):
    tape: KernelTape | None = None


_recording = _Recording()


@contextlib.contextmanager
def recording() -> Iterator[KernelTape]:
    """Record the kernel calls this thread makes inside the block into a new
    :class:`KernelTape`."""
    if _recording.tape is not None:
        raise RuntimeError("kernel calls are already being recorded on this thread")
    tape = _recording.tape = KernelTape()
    try:
        yield tape
    finally:
        _recording.tape = None


def run(fn: Any, args: tuple[Any, ...], *tensors: torch.Tensor | None) -> Any:
    """``fn(*args)``, a kernel of the library; while :func:`recording`, also onto the tape, with
    ``tensors``: every tensor whose memory ``args`` point into (None entries are skipped)."""
    rc = fn(*args)
    tape = _recording.tape
    if tape is not None:
        tape.calls.append((fn, args))
        tape.tensors.extend(t for t in tensors if t is not None)
    return rc


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
    :func:`requested_isa`); ``none`` where a kernel level was due but the library could not be
    built."""
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
        parts.append("kernels could not be built")
    elif level not in KERNEL_LEVELS:
        parts.append("torch operators only")
    return f"{level} ({', '.join(parts)})"


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


def _cache_dir() -> Path:
    from sgl.model_loader.gguf_cache import cache_root

    root = cache_root()
    return (root / "kernels") if root is not None else Path(tempfile.gettempdir()) / "sgl-kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(cc: str) -> Path:
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + version.encode() + repr(_FLAGS).encode()
                         + platform.machine().encode()).hexdigest()[:20]
    target = _cache_dir() / f"sgl_cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm", "-lpthread"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    lib.sgl_kernels_version.restype = _int
    lib.sgl_set_threads.restype = _int
    lib.sgl_set_threads.argtypes = [_int]
    lib.sgl_linear_bf16_amx.restype = _int
    lib.sgl_linear_bf16_amx.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr]
    lib.sgl_linear_bf16_avx512.restype = _int
    lib.sgl_linear_bf16_avx512.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr,
                                           _int]
    lib.sgl_linear_f32.restype = _int
    lib.sgl_linear_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr]
    lib.sgl_rmsnorm.restype = _int
    lib.sgl_rmsnorm.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64,
                                _i64, _f32, _int]
    lib.sgl_silu_mul.restype = _int
    lib.sgl_silu_mul.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _int]
    lib.sgl_rotary.restype = _int
    lib.sgl_rotary.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                               _int]
    lib.sgl_embedding.restype = _int
    lib.sgl_embedding.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64]
    lib.sgl_argmax_f32.restype = _int
    lib.sgl_argmax_f32.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
    lib.sgl_replay.restype = _i64
    lib.sgl_replay.argtypes = [_ptr, _i64]
    lib.sgl_decode_attention.restype = _int
    lib.sgl_decode_attention.argtypes = [
        _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
        _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _i64, _int, _int]


def _library() -> ctypes.CDLL | None:
    """The built library (built on the first call), or None where it cannot be built."""
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    _lib_tried = True
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found ($CC, cc, gcc, clang): sgl's CPU kernels are off, "
                       "torch runs everything (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
        _declare(lib)
    except (OSError, subprocess.CalledProcessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("could not build sgl's CPU kernels, using torch instead: %s", detail)
        return None
    _lib = lib
    return _lib


def load() -> CpuKernels | None:
    """The kernels at this process's level (see :func:`cpu_isa`), built on first use; None
    where they cannot be used (a level below ``avx512``, no compiler, another architecture)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        level = effective_isa(requested_isa())
        lib = _library() if level in KERNEL_LEVELS else None
        _loaded = None if lib is None else CpuKernels(lib=lib, isa=level)
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
        _threads = int(kernels.lib.sgl_set_threads(max(1, int(threads))))
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
            and logits.stride(1) == 1 and not logits.requires_grad):
        return kernels.argmax(logits)
    return logits.max(dim=-1).indices  # the same index as argmax, and 3-9x faster on CPU


def pack_amx_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` bfloat16 -> the layout :meth:`CpuKernels.linear_bf16` streams:
    ``[Np/32, Kp/32, 2, 16, 16, 2]`` with N and K zero-padded to multiples of 32."""
    n, k = weight.shape
    np_, kp = -(-n // 32) * 32, -(-k // 32) * 32
    w = weight.detach()
    if (np_, kp) != (n, k):
        w = torch.nn.functional.pad(w, (0, kp - k, 0, np_ - n))
    # [n-pair, half, n, k-block, k-pair, 2] -> [n-pair, k-block, half, k-pair, n, 2]
    return w.reshape(np_ // 32, 2, 16, kp // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def pack_f32_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` float32 -> the layout :meth:`CpuKernels.linear_f32` streams: ``[Np/32, K,
    32]`` (32-column panels of ``W^T``) with N zero-padded to a multiple of 32."""
    n, k = weight.shape
    np_ = -(-n // 32) * 32
    w = weight.detach()
    if np_ != n:
        w = torch.nn.functional.pad(w, (0, 0, 0, np_ - n))
    return w.reshape(np_ // 32, 32, k).transpose(1, 2).contiguous()
