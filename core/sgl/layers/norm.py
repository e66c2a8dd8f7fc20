"""Root-mean-square layer norm, optionally fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl.kernels import cpu

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension, normalised in float32 and rounded to
    ``x``'s dtype before the weight multiplies (transformers' order).

    On CPU this is one call of sgl's kernel (:mod:`sgl.kernels.cpu`, bit-identical for
    bfloat16); elsewhere ``F.rms_norm``, which upcasts half types internally, so it is
    bit-identical to spelling the float32 formula out, in one or two ops instead of eight.
    """
    if _kernels_take(x, weight):
        return torch.ops.sgl.rmsnorm(x.view(-1, x.shape[-1]), weight.view(1, -1),
                                     eps).view(x.shape)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def _kernels_take(x: torch.Tensor, weight: torch.Tensor,
                  residual: torch.Tensor | None = None) -> bool:
    """Whether sgl's CPU kernels take these tensors (one call for add + norm)."""
    if x.device.type != "cpu" or x.dim() < 2 or (x.dim() > 2 and not x.is_contiguous()):
        return False
    if residual is not None and (residual.shape != x.shape or x.dim() != 2):
        return False
    return cpu.load() is not None and cpu.fits(x.view(-1, x.shape[-1]), weight.view(1, -1),
                                               residual)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back to the input dtype.

    ``weight_offset`` (Gemma: 1.0) stores the scale as ``weight + weight_offset``; with an
    offset the product is taken in float32 before the cast, as Gemma's reference does.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(
            torch.full((hidden_size,), 1.0 - weight_offset, dtype=dtype, device=device),
            requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if not self.weight_offset:
            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x32 * (self.weight.float() + self.weight_offset)).to(dtype)
        return self.weight * x32.to(dtype)

    def per_head(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The norm over every ``head_dim``-wide part of the rows of ``x [T, heads * head_dim]``
        (per-head q/k norms; ``head_dim`` is this norm's size). On CPU one kernel call reads a
        row-strided view in place; elsewhere the rows are reshaped (a copy for a strided view)."""
        if (not self.weight_offset and x.dim() == 2 and x.device.type == "cpu"
                and x.shape[1] % head_dim == 0):
            if cpu.load() is not None and cpu.fits(x, self.weight.view(1, -1)):
                return torch.ops.sgl.rmsnorm_heads(x, self.weight.view(1, -1), self.eps,
                                                   head_dim)
        normed, _ = self(x.reshape(-1, head_dim))
        return normed.view(x.shape[0], -1)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; without ``residual``, ``(norm(x), x)``."""
        if residual is not None and not self.weight_offset:
            if _kernels_take(x, self.weight, residual):  # the add and the norm in one pass
                return torch.ops.sgl.add_rmsnorm(x, residual, self.weight.view(1, -1), self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x
