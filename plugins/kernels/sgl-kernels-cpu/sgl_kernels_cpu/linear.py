"""The weights this library's matmuls read, prepared once after loading
(:func:`sgl.layers.packed_linear.pack_weight` asks :func:`pack`), and when each matmul runs.

In decode every linear layer multiplies a few rows by the whole weight, so the time goes into
streaming the weight from memory. ``F.linear`` on bfloat16 goes through oneDNN, which reorders
the weight into its blocked layout on every call. The copies:

* ``"bf16"``: bfloat16 weights at every kernel level (:func:`sgl.kernels.cpu.kernel_levels`),
  the layout of :func:`sgl.kernels.ops.pack_bf16_weight`, multiplied by ``sgl::linear_bf16``: on AMX
  tiles, or on AVX-512 vectors without AMX (``vdpbf16ps`` on AMD, widened FMAs elsewhere; see
  ``CpuKernelLibrary.bf16_dot_matmul``), or widened on AVX2 vectors. Both read the
  weight in one sequential pass, split over the kernel's own threads
  (:func:`sgl.kernels.cpu.set_threads`). Used when torch runs on one thread: for any number of
  rows with two or more kernel threads, for up to :data:`AMX_MAX_ROWS` rows with one; otherwise
  ``F.linear`` on the plain weight.
  (Below the kernel levels the core packs bfloat16 weights for oneDNN instead.)

* ``"f32"``: float32 weights at every kernel level, the 32-column panels of
  :func:`sgl.kernels.ops.pack_f32_weight`, multiplied by ``sgl::linear_f32`` when torch runs on one
  thread: for any number of rows with two or more kernel threads (the panels split over them),
  for :data:`F32_MIN_ROWS` to :data:`F32_MAX_ROWS` rows with one. MKL reads the weight at memory
  speed for one or two rows but repacks it on every call for more. The measured row ranges
  and timings: docs/kernels.md, "Linear layers".
"""

from __future__ import annotations

import torch

from sgl.kernels import cpu
from sgl.kernels.library import PackedWeight

__all__ = ["AMX_MAX_ROWS", "F32_MAX_ROWS", "F32_MIN_ROWS", "KernelWeight", "pack"]

#: above this many rows the bfloat16 kernel on one thread loses to oneDNN (compute-bound prefill);
#: on two or more kernel threads it wins at every size measured (up to 512 rows)
AMX_MAX_ROWS = 128
#: the row range where the float32 panel kernel beats MKL
F32_MIN_ROWS, F32_MAX_ROWS = 4, 64

_sgl = torch.ops.sgl


class KernelWeight(PackedWeight):
    """A weight in the layout of ``sgl::linear_bf16`` (kind ``"bf16"``) or ``sgl::linear_f32``
    (``"f32"``), with a float32 copy of the bias."""

    def __init__(self, kind: str, tensor: torch.Tensor, n: int, dtype: torch.dtype,
                 bias: torch.Tensor | None) -> None:
        super().__init__(kind, tensor, n, dtype)
        self.bias = bias
        self.op = _sgl.linear_bf16 if kind == "bf16" else _sgl.linear_f32
        self.rows = (1, AMX_MAX_ROWS) if kind == "bf16" else (F32_MIN_ROWS, F32_MAX_ROWS)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if torch.get_num_threads() != 1:  # torch's threads and the kernels' would fight
            return None
        if cpu.kernel_threads() == 1 and not self.rows[0] <= rows <= self.rows[1]:
            return None  # with 2+ kernel threads the kernels beat one-thread torch at any size
        if rows == 0:
            return None
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        bias32 = None
        if bias is not None:
            bias32 = self.bias if self.bias is not None else bias.float()
        out = self.op(x2, self.tensor, self.n, bias32)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n)


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> KernelWeight | None:
    """The prepared copy of a 2-D CPU ``weight`` (and ``bias``) for this library's matmuls, or
    None for a dtype they do not take."""
    bias32 = None if bias is None else bias.detach().float()
    if weight.dtype == torch.bfloat16:
        return KernelWeight("bf16", cpu.pack_bf16_weight(weight), weight.shape[0], weight.dtype,
                            bias32)
    if weight.dtype == torch.float32:
        return KernelWeight("f32", cpu.pack_f32_weight(weight), weight.shape[0], weight.dtype,
                            bias32)
    return None
