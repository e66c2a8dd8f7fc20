"""Linear layers on CPU with the weight prepared once, after loading, for the small matmuls of
decode.

In decode every linear layer multiplies a few rows by the whole weight, so the time goes into
streaming the weight from memory. ``F.linear`` on bfloat16 goes through oneDNN, which reorders
the weight into its blocked layout on every call. :func:`pack_weight` prepares a copy once:

* ``"bf16"``: bfloat16 weights at every kernel level (:data:`sgl.kernels.cpu.KERNEL_LEVELS`),
  the layout of :func:`sgl.kernels.cpu.pack_amx_weight`, multiplied by sgl's own kernel: on AMX
  tiles, or on AVX-512 vectors without AMX (``vdpbf16ps`` on AMD, widened FMAs elsewhere; see
  ``CpuKernels.bf16_dot_matmul``). Both read the
  weight in one sequential pass, split over the kernel's own threads
  (:func:`sgl.kernels.cpu.set_threads`). Used when torch runs on one thread: for any number of
  rows with two or more kernel threads, for up to :data:`AMX_MAX_ROWS` rows with one; otherwise
  ``F.linear`` on the plain weight.
* ``"onednn"``: below the kernel levels, with oneDNN bfloat16 support, oneDNN's own packed
  layout.

The matmuls of one SmolLM2-135M decode step (30 layers plus the LM head, bfloat16, weights not
in cache, 1 thread, 2-core Sapphire Rapids VM; the three kinds interleaved in one process,
median of 7): the weights alone take 26-30 ms to read.

=====  ============  ===============  ==============
rows   ``F.linear``  oneDNN packed    AMX (used)
=====  ============  ===============  ==============
1      46-54 ms      40-48 ms         26-28 ms
8      --            45 ms            23-25 ms
32     55 ms         45-47 ms         32-35 ms
64     --            50-57 ms         40-45 ms
=====  ============  ===============  ==============

* ``"f32"``: float32 weights on CPUs with AVX-512, the 32-column panels of
  :func:`sgl.kernels.cpu.pack_f32_weight`, multiplied by sgl's own kernel when torch runs on one
  thread: for any number of rows with two or more kernel threads (the panels split over them),
  for :data:`F32_MIN_ROWS` to :data:`F32_MAX_ROWS` rows with one. MKL reads the weight at memory
  speed for one or two rows but repacks it on every call for more; the same matmuls in float32
  (30 layers + LM head, torch on 1 thread, median of 3; the last column measured later, in
  another run, next to MKL at 44, 46, 79, 133, 163 and 429 ms for 1, 2, 4, 32, 64, 256 rows):

  =====  ======  =====================  =======================
  rows   MKL     panels (used, 4-64)    panels, 2 kernel threads
  =====  ======  =====================  =======================
  1      48 ms   49 ms                  25 ms
  2      --      --                     28 ms
  4      95 ms   66 ms                  31 ms
  8      145 ms  78 ms                  --
  32     166 ms  128 ms                 57 ms
  64     206 ms  192 ms                 84 ms
  256    --      --                     247 ms
  =====  ======  =====================  =======================

The prepared copy is kept next to the plain weight (which loaders, state dicts, prefill
and other devices use), so it doubles the memory of linear weights.
``SGL_CPU_PACKED_LINEAR=0`` turns this off (for comparisons).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from sgl.kernels import cpu

__all__ = ["AMX_MAX_ROWS", "F32_MAX_ROWS", "F32_MIN_ROWS", "PACKED_DTYPES", "PackedWeight",
           "linear", "pack_weight"]

#: weight dtypes that :func:`pack_weight` prepares
PACKED_DTYPES = (torch.bfloat16, torch.float32)
#: above this many rows the bfloat16 kernel on one thread loses to oneDNN (compute-bound prefill);
#: on two or more kernel threads it wins at every size measured (up to 512 rows)
AMX_MAX_ROWS = 128
#: the row range where the float32 panel kernel beats MKL
F32_MIN_ROWS, F32_MAX_ROWS = 4, 64


class PackedWeight:
    """A prepared copy of a CPU weight ``[n, k]`` for :func:`linear`.

    Held as a plain attribute, so ``module.to(...)`` leaves it behind (:func:`linear` then falls
    back to the plain weight) and ``copy.deepcopy`` drops it (an opaque oneDNN tensor cannot be
    copied).
    """

    __slots__ = ("bias", "dtype", "kernel", "kind", "n", "tensor")

    def __init__(self, kind: str, tensor: torch.Tensor, n: int, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, kernel: Any = None) -> None:
        self.kind = kind  # "bf16", "f32" or "onednn"
        self.tensor = tensor
        self.n = n
        self.dtype = dtype
        self.bias = bias  # float32 copy of the bias, for "bf16" and "f32"
        self.kernel = kernel  # CpuKernels.linear_bf16 or linear_f32 of the level packed at

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        return None


def _packing_enabled() -> bool:
    return os.environ.get("SGL_CPU_PACKED_LINEAR", "1") != "0"


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """A prepared copy of ``weight`` ``[out, in]`` (and ``bias``), or None where none applies
    (not on CPU, a dtype outside :data:`PACKED_DTYPES`, no kernel for it on this CPU, or
    turned off)."""
    if (weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2
            or not _packing_enabled()):
        return None

    kernels = cpu.load()
    with torch.no_grad():
        if kernels is not None and weight.dtype == torch.bfloat16:
            return PackedWeight("bf16", cpu.pack_amx_weight(weight), weight.shape[0],
                                weight.dtype, None if bias is None else bias.detach().float(),
                                kernels.linear_bf16)
        if weight.dtype == torch.float32:
            if kernels is None:
                return None  # MKL's float32 matmul is as good as a oneDNN-packed one
            return PackedWeight("f32", cpu.pack_f32_weight(weight), weight.shape[0],
                                weight.dtype, None if bias is None else bias.detach().float(),
                                kernels.linear_f32)
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), None), weight.shape[0], weight.dtype)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` when it applies to ``x``."""
    if (packed is None or x.dtype != packed.dtype or x.device.type != "cpu"
            or x.requires_grad):
        return F.linear(x, weight, bias)
    if packed.kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if cpu.kernel_threads() > 1:  # the kernels beat one-thread torch at any size
        low, high = 1, 1 << 62
    elif packed.kind == "f32":
        low, high = F32_MIN_ROWS, F32_MAX_ROWS
    else:
        low, high = 1, AMX_MAX_ROWS
    if low <= rows <= high and torch.get_num_threads() == 1:
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        bias32 = None
        if bias is not None:
            bias32 = packed.bias if packed.bias is not None else bias.float()
        out = packed.kernel(x2, packed.tensor, packed.n, bias32)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], packed.n)
    return F.linear(x, weight, bias)
