"""What the readers of integer-packed checkpoints share (compressed-tensors' ``pack-quantized``,
GPTQ, AWQ): a folder's safetensors tensors with each quantized layer's parts read together, and
a layer's integers with a scale and a zero per group turned into the blocks of
:mod:`sgl.kernels.quant` (a folder's settings are read by
:func:`sgl.model_loader.config.quantization_config`).

:func:`grouped_weight` takes what every such format comes down to, ``W = (q - zero) * scale``
for unsigned integers ``q`` (0 .. 2^bits - 1) and a scale and a zero per group of columns, and
holds it as ``q4`` blocks (``q`` as it is, ``d = scale``, ``m = -zero * scale``) or ``q8``
blocks (``q - 128``, ``d = scale``, ``m = -(zero - 128) * scale``) where the groups are whole
blocks of 32 and ``d`` and ``m`` fit float16; else dense. ``d`` is the scale itself, and a
float16 (or bfloat16) scale is a float16 number; ``m`` is rounded to float16, within
``2^-11 |m|``, and is exact when the zero is the middle of the range (symmetric schemes:
``-8 scale`` for 4 bits, ``0`` for 8).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sgl.kernels.quant import BLOCK
from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.safetensors_weights import SafetensorsWeights

__all__ = ["PackedWeights", "grouped_weight", "unpack_rows"]

logger = logging.getLogger(__name__)


def unpack_rows(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The unsigned values (0 .. 2^bits - 1) packed along the rows of int32 ``packed``, value
    ``i`` at bits ``(i % (32 / bits)) * bits`` of word ``i // (32 / bits)``: ``count`` of each
    row, as uint8 (``bits`` 4 or 8)."""
    data = packed.contiguous().view(torch.uint8)  # little-endian words: value 0 in byte 0
    if bits == 8:
        return data[:, :count]
    nibbles = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(1)
    return nibbles[:, :count]


def grouped_weight(prefix: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   bits: int, *, quantized: bool) -> QuantizedTensor | torch.Tensor:
    """``W = (q - zero) * scale`` of the layer ``prefix``: ``q`` ``[N, K]`` unsigned integers of
    ``bits`` (4 or 8) bits, ``scale`` and ``zero`` ``[N, G]`` (any float dtype; a zero may be
    fractional) for each group of ``K / G`` columns. As ``q4``/``q8`` blocks (see the module
    docstring) when ``quantized`` and the groups allow it, else (with a log line saying why,
    when blocks were asked for) float32 dense."""
    q = q.contiguous()
    rows, cols = q.shape
    groups = scale.shape[1]
    group = cols // groups
    scale, zero = scale.float(), zero.float()
    if quantized:
        blocks = _blocks(prefix, q, scale, zero, bits, group)
        if blocks is not None:
            return blocks
    values = (q.float().view(rows, groups, group) - zero[..., None]) * scale[..., None]
    return values.view(rows, cols)


def _blocks(prefix: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
            group: int) -> QuantizedTensor | None:
    rows, cols = q.shape
    why = None
    offset = 0 if bits == 4 else 128  # q8 holds signed integers
    if group % BLOCK or cols % BLOCK:
        why = f"groups of {group} columns are not whole blocks of {BLOCK}"
    else:
        per_block = group // BLOCK
        d = scale.repeat_interleave(per_block, dim=1)
        m = -(zero - offset).repeat_interleave(per_block, dim=1) * d
        if max(d.abs().max().item(), m.abs().max().item()) > torch.finfo(torch.float16).max:
            why = "its scales exceed float16"
    if why is not None:
        logger.info("%s: dequantized (%s)", prefix, why)
        return None
    nb = cols // BLOCK
    scales = torch.stack([d, m], dim=-1).half()
    if bits == 8:
        signed = (q.to(torch.int16) - offset).to(torch.int8)
        return QuantizedTensor("q8", signed.view(rows, nb, BLOCK), scales)
    unsigned = q.to(torch.uint8).view(rows, nb, BLOCK)
    qweight = unsigned[..., :16] | (unsigned[..., 16:] << 4)
    return QuantizedTensor("q4", qweight.contiguous(), scales)


class PackedWeights(SafetensorsWeights):
    """The tensors of a folder whose quantized linear layers come as several parts
    (:attr:`PARTS`, the first naming the layer): each such layer is yielded once, as
    ``x.weight``, by :meth:`_weight`; every other tensor as it is (floats cast to ``dtype``).
    ``quantized``: blocks where sgl runs them, else dense."""

    #: what a quantized layer's parts are called after its module name; the first is always
    #: there and names the layer
    PARTS: tuple[str, ...] = ()

    def __init__(self, path: Path, dtype: torch.dtype, *, quantized: bool) -> None:
        super().__init__(path, dtype)
        self.quantized = quantized
        self._where: dict[str, Path] | None = None

    @abstractmethod
    def _weight(self, prefix: str,
                parts: dict[str, torch.Tensor]) -> QuantizedTensor | torch.Tensor:
        """The weight of the layer ``prefix`` from its ``parts`` (by part name): blocks, or a
        dense tensor (cast to ``dtype`` by the caller); :class:`ModelLoadError` naming the layer
        when they are malformed."""

    def where(self) -> dict[str, Path]:
        """Every tensor's name and the shard that holds it (a layer's parts may be split)."""
        if self._where is None:
            self._where = {}
            for file in self.files:
                with self._open(file) as handle:
                    self._where.update(dict.fromkeys(handle.keys(), file))
        return self._where

    def _layers(self) -> set[str]:
        head = f".{self.PARTS[0]}"
        return {name.removesuffix(head) for name in self.where() if name.endswith(head)}

    def _is_part(self, name: str, layers: set[str]) -> bool:
        prefix, _, part = name.rpartition(".")
        return part in self.PARTS and prefix in layers

    def __len__(self) -> int:
        layers = self._layers()
        return sum(1 for name in self.where() if not self._is_part(name, layers)) + len(layers)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        where, layers = self.where(), self._layers()
        handles: dict[Path, Any] = {}
        try:
            for name in where:
                prefix, _, part = name.rpartition(".")
                if part == self.PARTS[0] and prefix in layers:
                    parts = {p: self._read(handles, where, f"{prefix}.{p}")
                             for p in self.PARTS if f"{prefix}.{p}" in where}
                    weight = self._weight(prefix, parts)
                    yield f"{prefix}.weight", (weight if isinstance(weight, QuantizedTensor)
                                               else self._cast(weight))
                elif not self._is_part(name, layers):
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
