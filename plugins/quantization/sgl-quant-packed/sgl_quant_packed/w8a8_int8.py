"""Weights of an SGLang ``w8a8_int8`` checkpoint (``quantization_config.quant_method:
w8a8_int8``, e.g. the channel-wise INT8 releases of large models): each quantized linear layer
``x`` stores ``x.weight`` as int8 ``[N, K]`` and ``x.weight_scale`` as float ``[N, 1]``, ``W =
weight_scale * weight``, and its activations are rounded to int8 per token at run time.

:class:`W8A8Int8Weights` yields each such layer's ``x.weight`` as a ``w8``
:class:`~sgl.layers.quantized.QuantizedTensor` (what ``sgl::linear_w8a8`` multiplies), or
dequantized when asked for dense tensors; every other tensor as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl_quant_packed.packed import PackedWeights

__all__ = ["QUANT_METHOD", "W8A8Int8Weights", "check_w8a8_int8"]

#: ``quantization_config.quant_method`` of these checkpoints
QUANT_METHOD = "w8a8_int8"


def check_w8a8_int8(quant: dict[str, Any], name: str) -> None:
    """ValueError for what sgl cannot run in the ``w8a8_int8`` checkpoint ``name``: static
    (calibrated) activation scales; the scheme's activations are dynamic, per token."""
    scheme = str(quant.get("activation_scheme") or "dynamic").lower()
    if scheme != "dynamic":
        raise ValueError(f"{name} is a w8a8_int8 checkpoint with {scheme} activation scales; "
                         "sgl runs the dynamic (per-token) scheme")


class W8A8Int8Weights(PackedWeights):
    """The tensors of a ``w8a8_int8`` folder, each quantized layer's weight and scale as one
    ``weight``: ``w8`` when ``quantized``, else dense."""

    PARTS = ("weight_scale", "weight")

    def _weight(self, prefix: str,
                parts: dict[str, torch.Tensor]) -> QuantizedTensor | torch.Tensor:
        if "weight" not in parts:
            raise ModelLoadError(f"{prefix}: weight_scale without weight")
        weight, scale = parts["weight"], parts["weight_scale"].float()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ModelLoadError(f"{prefix}.weight: expected int8 [N, K] beside weight_scale, "
                                 f"got {weight.dtype} {list(weight.shape)}")
        rows = weight.shape[0]
        if scale.numel() == 1:  # one scale for the tensor
            scale = scale.reshape(1, 1).expand(rows, 1)
        if scale.numel() != rows:
            raise ModelLoadError(f"{prefix}.weight_scale: {list(scale.shape)} is not one scale "
                                 f"per output channel of the weight [{rows}, {weight.shape[1]}]")
        scale = scale.reshape(rows, 1).contiguous()
        if not self.quantized:
            return weight.float() * scale
        return QuantizedTensor("w8", weight.contiguous(), scale)
