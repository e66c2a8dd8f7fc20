"""Linear layers on CPU with the weight reordered for oneDNN once, after loading.

``F.linear`` on a bfloat16 CPU tensor goes through oneDNN, which reorders the weight into its
blocked layout on every call. :func:`pack_weight` does that reorder once and :func:`linear` calls
oneDNN's linear op on the packed copy. Results are the same as ``F.linear`` (the same oneDNN
kernel runs); the speed-up is largest where the weight is streamed from memory, i.e. decode.
Measured on a 2-core Sapphire Rapids VM, 1 torch thread, the matmuls of one SmolLM2-135M decode
step (30 layers plus the LM head, weights not in cache), interleaved runs, median:

==========  ========  ================  ===============
dtype       batch     ``F.linear``      packed (used)
==========  ========  ================  ===============
bfloat16    1         46 ms             31 ms
bfloat16    32        55 ms             41 ms
float32     1         47 ms             (not packed)
float32     32        152 ms            (not packed)
==========  ========  ================  ===============

float32 is left to ``F.linear`` (MKL): packing it helped at batch 32 but not at batch 1 (see
``docs/benchmarks.md``). The packed copy is kept next to the plain weight (which loaders,
state dicts and other devices use), so packing doubles the memory of the packed weights.
``SGL_CPU_PACKED_LINEAR=0`` turns packing off (for comparisons).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["PACKED_DTYPES", "PackedWeight", "linear", "pack_weight"]

#: weight dtypes that :func:`pack_weight` packs
PACKED_DTYPES = (torch.bfloat16,)


class PackedWeight:
    """A oneDNN-packed copy of a CPU weight, for :func:`linear`.

    Held as a plain attribute, so ``module.to(...)`` leaves it behind (:func:`linear` then falls
    back to the plain weight) and ``copy.deepcopy`` drops it (an opaque oneDNN tensor cannot be
    copied).
    """

    __slots__ = ("dtype", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.dtype = tensor.dtype

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        return None


def _packing_enabled() -> bool:
    return os.environ.get("SGL_CPU_PACKED_LINEAR", "1") != "0"


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A packed copy of ``weight`` ``[out, in]``, or None where packing does not apply (not on
    CPU, a dtype outside :data:`PACKED_DTYPES`, no oneDNN bfloat16 support, or turned off)."""
    if (weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2
            or not _packing_enabled() or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    with torch.no_grad():
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` when it applies to ``x``."""
    if (packed is not None and x.dtype == packed.dtype and x.device.type == "cpu"
            and not x.requires_grad):
        return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
    return F.linear(x, weight, bias)
