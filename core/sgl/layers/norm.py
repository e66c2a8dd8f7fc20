"""Root-mean-square layer norm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


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
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x32 * (self.weight.float() + self.weight_offset)).to(dtype)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; without ``residual``, ``(norm(x), x)``."""
        if residual is not None:
            x = x + residual
        return self._norm(x), x
