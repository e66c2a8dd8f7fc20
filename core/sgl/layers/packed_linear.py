"""Linear layers on CPU with the weight prepared once, after loading, for the small matmuls of
decode.

In decode every linear layer multiplies a few rows by the whole weight, so the time goes into
streaming the weight from memory, and ``F.linear`` on bfloat16 goes through oneDNN, which
reorders the weight into its blocked layout on every call. :func:`pack_weight` prepares a copy
once: the CPU kernel library's (sgl-kernels-cpu: bfloat16 and float32 layouts for its own
matmuls, see ``sgl_kernels_cpu.linear``) where one is loaded, else, for bfloat16 with oneDNN
support, oneDNN's packed layout. :func:`linear` multiplies through the copy when the copy says
it is faster for these rows, else with ``F.linear`` on the plain weight.

The copy is kept next to the plain weight (which loaders, state dicts, prefill and other
devices use), so it doubles the memory of linear weights. ``SGL_CPU_PACKED_LINEAR=0`` turns
this off (for comparisons).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from sgl.kernels import cpu
from sgl.kernels.library import PackedWeight

__all__ = ["OneDnnWeight", "linear", "pack_weight"]


class OneDnnWeight(PackedWeight):
    """oneDNN's packed layout of a bfloat16 weight (torch's ``mkldnn`` linear)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")


def _packing_enabled() -> bool:
    return os.environ.get("SGL_CPU_PACKED_LINEAR", "1") != "0"


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """A prepared copy of ``weight`` ``[out, in]`` (and ``bias``), or None where none applies
    (not on CPU, not 2-D, nothing faster for its dtype on this CPU, or turned off)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not _packing_enabled():
        return None
    library = cpu.load()
    with torch.no_grad():
        if library is not None:
            packed = library.pack_linear(weight, bias)
            if packed is not None:
                return packed
        if (weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return OneDnnWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), None), weight.shape[0], weight.dtype)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` when it applies to ``x``."""
    if (packed is not None and x.dtype == packed.dtype and x.device.type == "cpu"
            and not x.requires_grad):
        out = packed.matmul(x, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)
