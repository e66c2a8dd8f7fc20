"""Weights of a ``compressed-tensors`` checkpoint (what llm-compressor writes and vLLM/SGLang
serve, e.g. the ``*-quantized.w4a16`` models), in its ``pack-quantized`` format: weight-only
int4 or int8 integers packed into int32 words, with a scale (and for asymmetric schemes a zero
point) per group of columns or per output channel.

A quantized linear layer ``x`` arrives as ``x.weight_packed`` (int32 ``[N, K * bits / 32]``,
value ``i`` of a row at bits ``i * bits``, stored plus ``2^(bits - 1)``), ``x.weight_scale``
(``[N, K / group]``, ``[N, 1]`` per channel), ``x.weight_shape`` (``[N, K]``) and, when
asymmetric, ``x.weight_zero_point`` (``[N, K / group]`` packed the same way along N). The value
is ``W = (q - zero_point) * scale`` for the signed ``q``.

:class:`CompressedTensorsWeights` yields ``x.weight`` instead: as the blocks of
:mod:`sgl.kernels.quant` (``q4``: ``d = scale``, ``m = -(8 + zero_point) * scale``; ``q8``:
``d = scale``, ``m = -zero_point * scale``) where the groups are whole blocks of 32 and the
numbers fit float16, else (or when asked for dense tensors) dequantized
(:func:`sgl_quant_packed.packed.grouped_weight`, which the GPTQ and AWQ reader shares).
"""

from __future__ import annotations

from typing import Any

import torch

from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl_quant_packed.packed import PackedWeights, grouped_weight, unpack_rows

__all__ = ["QUANT_METHOD", "CompressedTensorsWeights", "check_compressed_tensors"]

#: ``quantization_config.quant_method`` of these checkpoints
QUANT_METHOD = "compressed-tensors"
#: the one format read: weight-only integers packed into int32
PACKED = "pack-quantized"
#: what a quantized layer's parts are called, after its module name (a ``weight_g_idx``, of
#: activation-ordered groups, is refused)
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def check_compressed_tensors(quant: dict[str, Any], name: str) -> None:
    """ValueError naming what sgl cannot run in the compressed-tensors checkpoint ``name``:
    anything but weight-only ``pack-quantized`` integers of 4 or 8 bits in groups or per
    channel."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"{name} is a compressed-tensors checkpoint with {what}; sgl runs "
                          f"weight-only {PACKED} int4/int8 schemes (W4A16, W8A16) in groups "
                          "or per channel")

    if quant.get("sparsity_config"):
        raise refuse("a sparsity config")
    if quant.get("transform_config"):
        raise refuse("transforms (rotations)")
    if quant.get("kv_cache_scheme"):
        raise refuse("a quantized KV cache scheme")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    for group_name, scheme in groups.items():
        fmt = scheme.get("format") or quant.get("format")
        if fmt != PACKED:
            raise refuse(f"format {fmt!r} in {group_name}")
        if scheme.get("input_activations") or scheme.get("output_activations"):
            raise refuse(f"quantized activations in {group_name} (W8A8/W4A8)")
        weights = scheme.get("weights") or {}
        if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
            raise refuse(f"{weights.get('num_bits')}-bit {weights.get('type')} weights in "
                         f"{group_name}")
        if weights.get("strategy") not in ("group", "channel", "tensor"):
            raise refuse(f"the {weights.get('strategy')!r} strategy in {group_name}")
        if weights.get("actorder") == "group":
            raise refuse(f"activation-ordered groups (actorder: group) in {group_name}")


class CompressedTensorsWeights(PackedWeights):
    """The tensors of a compressed-tensors folder, each quantized layer's parts as one
    ``weight``: :class:`~sgl.layers.quantized.QuantizedTensor` blocks when ``quantized``,
    else dense (see the module docstring)."""

    PARTS = PARTS

    def _weight(self, prefix: str,
                parts: dict[str, torch.Tensor]) -> QuantizedTensor | torch.Tensor:
        if "weight_g_idx" in parts:
            raise ModelLoadError(f"{prefix}.weight_g_idx: activation-ordered groups (a g_idx) "
                                 "are not supported")
        for needed in ("weight_scale", "weight_shape"):
            if needed not in parts:
                raise ModelLoadError(f"{prefix}: weight_packed without {needed}")
        packed, scale = parts["weight_packed"], parts["weight_scale"].float()
        rows, cols = (int(n) for n in parts["weight_shape"].tolist())
        bits = packed.shape[1] * 32 // cols if cols else 0
        if packed.dtype != torch.int32 or packed.shape[0] != rows or bits not in (4, 8) \
                or packed.shape[1] != -(-cols * bits // 32):
            raise ModelLoadError(f"{prefix}: weight_packed {packed.dtype} "
                                 f"{list(packed.shape)} is not a 4- or 8-bit packing of "
                                 f"[{rows}, {cols}]")
        if scale.dim() == 1 or scale.numel() == 1:
            scale = scale.reshape(-1, 1).expand(rows, 1)
        groups = scale.shape[1]
        if scale.shape[0] != rows or cols % groups:
            raise ModelLoadError(f"{prefix}: weight_scale {list(scale.shape)} does not divide "
                                 f"the weight [{rows}, {cols}] into groups")
        half = 1 << (bits - 1)  # the stored integers and zero points are signed: q + half
        zero = torch.full((rows, groups), float(half))
        if "weight_zero_point" in parts:  # packed along N like the weight along K
            zp = parts["weight_zero_point"]
            if zp.dtype == torch.int32:
                zp = unpack_rows(zp.t(), bits, rows).t().to(torch.int16) - half
            zero = zp.float().reshape(-1, zp.shape[-1] if zp.dim() > 1 else 1).expand(
                rows, groups) + half
        return grouped_weight(prefix, unpack_rows(packed, bits, cols), scale, zero, bits,
                              quantized=self.quantized)
