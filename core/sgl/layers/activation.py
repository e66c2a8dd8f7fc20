"""Activation functions of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl.kernels import cpu

__all__ = ["SUPPORTED_GATED_ACTIVATIONS", "GatedActivation"]

SUPPORTED_GATED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


class GatedActivation(nn.Module):
    """``act(x[..., :d]) * x[..., d:]`` for the fused ``gate_up`` output of width ``2 d``."""

    def __init__(self, name: str = "silu") -> None:
        super().__init__()
        if name not in SUPPORTED_GATED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {name!r}; supported: "
                f"{', '.join(SUPPORTED_GATED_ACTIVATIONS)}"
            )
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "silu" and x.dim() == 2 and x.device.type == "cpu":
            if cpu.load() is not None and cpu.fits(x):  # one pass, same rounding as below
                return torch.ops.sgl.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        if self.name == "silu":
            return F.silu(gate) * up
        approximate = "tanh" if self.name == "gelu_pytorch_tanh" else "none"
        return F.gelu(gate, approximate=approximate) * up
