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
numbers fit float16, else (or when asked for dense tensors) dequantized.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sgl.kernels.quant import BLOCK
from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.safetensors_weights import SafetensorsWeights

__all__ = ["QUANT_METHOD", "CompressedTensorsWeights", "check_compressed_tensors",
           "compressed_tensors_config"]

logger = logging.getLogger(__name__)

#: ``quantization_config.quant_method`` of these checkpoints
QUANT_METHOD = "compressed-tensors"
#: the one format read: weight-only integers packed into int32
PACKED = "pack-quantized"
#: what a quantized layer's parts are called, after its module name
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def compressed_tensors_config(path: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of the folder ``path`` if it is a compressed-tensors one."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        quant = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD:
        return quant
    return None


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


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The unsigned values (0 .. 2^bits - 1) of the rows of int32 ``packed``, ``count`` each,
    as uint8."""
    data = packed.contiguous().view(torch.uint8)  # little-endian words: value 0 in byte 0
    if bits == 8:
        return data[:, :count]
    nibbles = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(1)
    return nibbles[:, :count]


class CompressedTensorsWeights(SafetensorsWeights):
    """The tensors of a compressed-tensors folder, each quantized layer's parts as one
    ``weight``: :class:`~sgl.layers.quantized.QuantizedTensor` blocks when ``quantized``,
    else dense (see the module docstring)."""

    def __init__(self, path: Path, dtype: torch.dtype, *, quantized: bool) -> None:
        super().__init__(path, dtype)
        self.quantized = quantized
        self._where: dict[str, Path] | None = None

    def where(self) -> dict[str, Path]:
        """Every tensor's name and the shard that holds it (a layer's parts may be split)."""
        if self._where is None:
            self._where = {}
            for file in self.files:
                with self._open(file) as handle:
                    self._where.update(dict.fromkeys(handle.keys(), file))
        return self._where

    def __len__(self) -> int:
        return sum(1 for name in self.where() if not _is_part(name)
                   or name.endswith(".weight_packed"))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        where = self.where()
        handles: dict[Path, Any] = {}
        try:
            for name, file in where.items():
                if name.endswith(".weight_packed"):
                    prefix = name.removesuffix(".weight_packed")
                    parts = {part: self._read(handles, where, f"{prefix}.{part}")
                             for part in PARTS if f"{prefix}.{part}" in where}
                    yield f"{prefix}.weight", self._weight(prefix, parts)
                elif name.endswith(".weight_g_idx"):
                    raise ModelLoadError(f"{name}: activation-ordered groups (a g_idx) are "
                                         "not supported")
                elif not _is_part(name):
                    yield name, self._cast(self._read(handles, where, name))
        finally:
            for handle in handles.values():
                handle.__exit__(None, None, None)

    def _read(self, handles: dict[Path, Any], where: dict[str, Path], name: str) -> torch.Tensor:
        file = where[name]
        if file not in handles:
            handles[file] = self._open(file).__enter__()
        try:
            return handles[file].get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"cannot read tensor {name!r} from {str(file)!r}: {exc}") \
                from exc

    def _weight(self, prefix: str,
                parts: dict[str, torch.Tensor]) -> QuantizedTensor | torch.Tensor:
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
        group = cols // groups
        signed = _unpack(packed, bits, cols).to(torch.int16) - (1 << (bits - 1))
        zero = torch.zeros((rows, groups))
        if "weight_zero_point" in parts:  # packed along N like the weight along K
            zp = parts["weight_zero_point"]
            if zp.dtype == torch.int32:
                zp = _unpack(zp.t(), bits, rows).t().to(torch.int16) - (1 << (bits - 1))
            zero = zp.float().reshape(-1, zp.shape[-1] if zp.dim() > 1 else 1).expand(
                rows, groups)
        if self.quantized:
            blocks = self._blocks(prefix, signed, scale, zero, bits, group)
            if blocks is not None:
                return blocks
        values = (signed.float().view(rows, groups, group) - zero[..., None]) * scale[..., None]
        return self._cast(values.view(rows, cols))

    def _blocks(self, prefix: str, signed: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor, bits: int, group: int) -> QuantizedTensor | None:
        rows, cols = signed.shape
        why = None
        if group % BLOCK or cols % BLOCK:
            why = f"groups of {group} columns are not whole blocks of {BLOCK}"
        else:
            per_block = group // BLOCK
            d = scale.repeat_interleave(per_block, dim=1)
            m = -(zero + (8 if bits == 4 else 0)).repeat_interleave(per_block, dim=1) * d
            if max(d.abs().max().item(), m.abs().max().item()) > torch.finfo(torch.float16).max:
                why = "its scales exceed float16"
        if why is not None:
            logger.info("%s: dequantized (%s)", prefix, why)
            return None
        nb = cols // BLOCK
        scales = torch.stack([d, m], dim=-1).half()
        if bits == 8:
            return QuantizedTensor("q8", signed.to(torch.int8).view(rows, nb, BLOCK), scales)
        unsigned = (signed + 8).to(torch.uint8).view(rows, nb, BLOCK)
        qweight = unsigned[..., :16] | (unsigned[..., 16:] << 4)
        return QuantizedTensor("q4", qweight.contiguous(), scales)


def _is_part(name: str) -> bool:
    return name.rpartition(".")[2] in PARTS
