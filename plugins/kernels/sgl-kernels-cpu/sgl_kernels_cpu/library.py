"""The compiled CPU kernels, loaded into torch's dispatcher, and their controls.

Loading ``_C`` (built by ``setup.py`` when the package was installed) registers the CPU
implementations of the ``torch.ops.sgl`` operators (:mod:`sgl.kernels.ops`) and this library's
controls, ``torch.ops.sgl_cpu``: ``set_level``, ``set_threads``, ``record_begin``/``record_end``
(this thread's calls, each kept as one row of an int64 tensor: the kernel and its arguments) and
``replay`` (those rows run again in one call, with no Python or dispatcher between them).
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sgl.kernels import cpu
from sgl.kernels import ops as _ops  # noqa: F401  (declares the sgl operators _C implements)
from sgl.kernels.library import DecodeGraphs, KernelLibrary, KernelLibraryUnavailable, KernelTape
from sgl.kernels.library import PackedWeight
from sgl_kernels_cpu import isa, linear

if TYPE_CHECKING:
    from sgl.attention.base import BaseAttentionBackend

__all__ = ["KERNEL_NAMES", "CpuKernelLibrary", "compiled_path"]

#: the kernel of each op kind in a recorded row (``SGL_OP_*`` in csrc/cpu_kernels.h)
KERNEL_NAMES = {1: "sgl_linear_bf16_amx", 2: "sgl_linear_f32", 3: "sgl_rmsnorm",
                4: "sgl_silu_mul", 5: "sgl_rotary", 6: "sgl_embedding",
                7: "sgl_decode_attention", 8: "sgl_argmax_f32", 9: "sgl_linear_bf16_avx512",
                10: "sgl_extend_attention", 11: "sgl_linear_bf16_avx2", 12: "sgl_linear_f32_avx2",
                13: "sgl_rmsnorm_avx2", 14: "sgl_silu_mul_avx2", 15: "sgl_rotary_avx2",
                16: "sgl_decode_attention_avx2", 17: "sgl_argmax_f32_avx2",
                18: "sgl_extend_attention_avx2", 19: "sgl_linear_quant_avx2",
                20: "sgl_embedding_quant", 21: "sgl_linear_quant_avx512",
                22: "sgl_linear_w8a8_avx2", 23: "sgl_linear_w8a8_avx512"}
#: what ``sgl_kernels_version`` of a build of this source returns
VERSION = 15

_lock = threading.Lock()
_loaded_path: Path | None = None


def compiled_path() -> Path | None:
    """The built ``_C`` library, or None where the package was installed without it."""
    spec = importlib.util.find_spec("sgl_kernels_cpu._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _load() -> Path:
    global _loaded_path
    with _lock:
        if _loaded_path is not None:
            return _loaded_path
        path = compiled_path()
        if path is None:
            raise KernelLibraryUnavailable(
                "sgl-kernels-cpu was installed without its compiled kernels (no C/C++ compiler "
                "then, or not x86-64); reinstall it with gcc/g++ present: pip install "
                "--no-build-isolation --force-reinstall plugins/kernels/sgl-kernels-cpu")
        try:
            torch.ops.load_library(str(path))
        except OSError as exc:
            raise KernelLibraryUnavailable(
                f"sgl-kernels-cpu's compiled kernels do not load ({exc}); they were built for "
                "another torch: reinstall the plugin (make install)") from exc
        version = torch.ops.sgl_cpu.version()
        if version != VERSION:
            raise KernelLibraryUnavailable(
                f"sgl-kernels-cpu's compiled kernels are version {version}, this Python code "
                f"expects {VERSION}: reinstall the plugin (make install)")
        _loaded_path = path
        return path


class CpuKernelLibrary(KernelLibrary):
    """sgl's CPU kernels (AMX, AVX512-BF16, AVX-512, AVX2), implementing the ``sgl`` operators."""

    levels = ("amx", "avx512_bf16", "avx512", "avx2")

    def __init__(self) -> None:
        self.path = _load()
        self._ops = torch.ops.sgl_cpu
        self.isa = "none"  # set_level's
        self.emulated = False

    def detect_isa(self) -> str:
        return isa.detect_isa()

    def set_level(self, level: str, emulated: bool = False,
                  dot_products: bool | None = None) -> None:
        """Run the kernels of ``level``, in software where ``emulated``; ``dot_products``
        chooses the bfloat16 matmul without AMX (``vdpbf16ps`` rather than widened FMAs;
        default: :meth:`bf16_dot_matmul`)."""
        if dot_products is None:
            dot_products = self.bf16_dot_matmul(level)
        self._ops.set_level(level, dot_products, emulated)
        self.isa = level
        self.emulated = emulated

    def emulated_levels(self) -> tuple[str, ...]:
        """The levels above the CPU's, where the build has them in software
        (``csrc/kernels_avx512_emulated.c``, compiled for AVX2: only on a CPU with AVX2)."""
        detected = self.detect_isa()
        if detected not in self.levels or not self._ops.emulation():
            return ()
        return self.levels[:self.levels.index(detected)]

    def bfloat16_faster(self, level: str) -> bool:
        """At ``amx`` and ``avx512_bf16``: bfloat16 instructions, half the bytes read."""
        return level in ("amx", "avx512_bf16")

    @staticmethod
    def bf16_dot_matmul(level: str) -> bool:
        """Whether the bfloat16 matmul without AMX uses ``vdpbf16ps`` rather than widening to
        fp32 FMAs: on AMD only. On Intel (Sapphire Rapids with AMX capped, 2 cores) the widened
        kernel measured 1.65x the dot-product one at 32 rows (134 vs 81 GFLOP/s on one thread)
        and equal at 1 row; on Zen 4 ``vdpbf16ps`` does twice the products of an FMA at the same
        rate (not measured here)."""
        return level == "avx512_bf16" and isa.cpu_vendor() == "AuthenticAMD"

    def set_threads(self, threads: int) -> int:
        return int(self._ops.set_threads(threads))

    def record_begin(self, arena: torch.Tensor | None = None) -> None:
        self._ops.record_begin(arena)

    def record_end(self) -> KernelTape:
        calls, inputs, outputs, arena_used = self._ops.record_end()
        return KernelTape(self, calls, list(inputs), list(outputs), calls.shape[0],
                          int(arena_used))

    def call_names(self, tape: KernelTape) -> list[str]:
        if not tape.count:
            return []
        return [KERNEL_NAMES.get(kind, f"kind {kind}") for kind in tape.calls[:, 0].tolist()]

    def replay(self, tape: KernelTape) -> None:
        failed = int(self._ops.replay(tape.calls))
        if failed:
            name = self.call_names(tape)[failed - 1]
            raise RuntimeError(f"{name} failed on replay (call {failed} of {tape.count})")

    def replay_parts(self, tapes: list[KernelTape]) -> None:
        failed = self._ops.replay_parts([tape.calls for tape in tapes])
        for tape, call in zip(tapes, failed):
            if call:
                name = self.call_names(tape)[call - 1]
                raise RuntimeError(f"{name} failed on replay (call {call} of {tape.count})")

    def pack_linear(self, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> PackedWeight | None:
        return linear.pack(weight, bias)

    def extend_attention_faster(self, dtype: torch.dtype) -> bool:
        """Whether the extend kernel runs for ``dtype``: float32 and bfloat16, at every level.
        On two kernel threads it is faster than torch's SDPA on one at every level measured
        (docs/kernels.md, "Extend (prefill) attention"). The kernel computes in float32; at
        ``amx`` and ``avx512_bf16`` its bfloat16 scores are vdpbf16ps products (exact, summed
        in float32).

        It runs wherever it takes the dtype, even where SDPA is as fast (bfloat16 at ``amx``,
        one kernel thread): SDPA's sums over a row's keys depend on how many query rows come
        with it, so a prompt's last token computed alone after a prefix-cache hit would not be
        the same row as in the cold prefill, and greedy output would depend on the cache."""
        return dtype in (torch.float32, torch.bfloat16)

    def round_x_faster(self) -> bool:
        # every level's integer tiles (vpdpbusd with VNNI, vpmaddubsw + vpmaddwd without, AMX
        # tiles from 16 rows) measured at least as fast as the exact ones from 1 row to 128
        # (docs/benchmarks.md, "Int8 activations in every matmul")
        return self.isa != "none"

    def packs_x16(self) -> bool:
        # the x16 layout's kernel is vpdpbusd on 512-bit vectors (AMX tiles from 16 rows at amx):
        # at the AVX-512 levels where the CPU has AVX512-VNNI, or emulated. It reads a thread's
        # columns as one stream with no transpose per call: against the octet tiles on the GGUF
        # layout, 1.2-1.3x the bytes per second at 1 row and 1.5-1.9x at 8 on Zen 4
        # (benchmarks/int8_matmul.py --kinds q4x,q4x16,q8x,q8x16)
        return self.isa in ("amx", "avx512_bf16", "avx512") and (
            self.emulated or isa.has_feature("avx512_vnni"))

    def decode_attention_fits(self, num_heads: int, num_kv_heads: int, head_dim: int,
                              v_dim: int) -> bool:
        return (num_kv_heads >= 1 and num_heads % num_kv_heads == 0 and num_heads <= 256
                and all(d % 16 == 0 and 16 <= d <= 256 for d in (head_dim, v_dim)))

    def decode_graphs(self, model: torch.nn.Module, backend: BaseAttentionBackend
                      ) -> DecodeGraphs:
        """Recordings of this library's calls in decode forwards, replayed
        (:class:`sgl_kernels_cpu.graphs.CpuGraphRunner`)."""
        from sgl_kernels_cpu.graphs import CpuGraphRunner

        return CpuGraphRunner(model, backend)

    def describe(self) -> str:
        return f"sgl-kernels-cpu, {self.path.name}"
