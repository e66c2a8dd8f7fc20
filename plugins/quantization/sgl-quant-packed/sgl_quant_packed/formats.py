"""The formats as :class:`sgl.model_loader.formats.WeightFormat` s: the checks of
:mod:`~sgl_quant_packed.gptq_awq` and :mod:`~sgl_quant_packed.compressed_tensors`, and their
readers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sgl.model_loader.formats import WeightFormat
from sgl_quant_packed.compressed_tensors import (
    QUANT_METHOD,
    CompressedTensorsWeights,
    check_compressed_tensors,
)
from sgl_quant_packed.gptq_awq import AWQ as AWQ_METHOD
from sgl_quant_packed.gptq_awq import GPTQ as GPTQ_METHOD
from sgl_quant_packed.gptq_awq import GPTQAWQWeights, check_gptq_awq
from sgl_quant_packed.packed import PackedWeights
from sgl_quant_packed.w8a8_int8 import QUANT_METHOD as W8A8_METHOD
from sgl_quant_packed.w8a8_int8 import W8A8Int8Weights, check_w8a8_int8

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from sgl.model_loader.source import WeightSource

__all__ = ["AWQ", "GPTQ", "CompressedTensors", "W8A8Int8"]


class _PerLayerFormat(WeightFormat):
    """A format whose reader needs only the folder, the dtype and whether to keep the layers
    quantized (:attr:`reader`)."""

    reader: ClassVar[type[PackedWeights]]

    @classmethod
    def open(cls, path: Path, dtype: torch.dtype, quant: dict[str, Any], *,
             quantized: bool) -> WeightSource:
        return cls.reader(path, dtype, quantized=quantized)


class CompressedTensors(_PerLayerFormat):
    """llm-compressor's ``pack-quantized`` checkpoints (W4A16, W8A16)."""

    name = QUANT_METHOD
    description = "a compressed-tensors"
    check = staticmethod(check_compressed_tensors)
    reader = CompressedTensorsWeights


class GPTQ(WeightFormat):
    """AutoGPTQ's and GPTQModel's checkpoints, 4 and 8 bits (and :class:`AWQ`, which the same
    reader takes)."""

    name = GPTQ_METHOD
    description = "a GPTQ"
    settings_files = ("quantize_config.json",)
    check = staticmethod(check_gptq_awq)

    @classmethod
    def open(cls, path: Path, dtype: torch.dtype, quant: dict[str, Any], *,
             quantized: bool) -> WeightSource:
        return GPTQAWQWeights(path, dtype, quant, quantized=quantized)


class AWQ(GPTQ):
    """AutoAWQ's checkpoints of the GEMM version, 4 bits."""

    name = AWQ_METHOD
    description = "an AWQ"
    settings_files = ("quant_config.json",)


class W8A8Int8(_PerLayerFormat):
    """SGLang's ``w8a8_int8`` checkpoints: int8 weights per output channel, int8 activations
    per token."""

    name = W8A8_METHOD
    description = "a w8a8_int8"
    check = staticmethod(check_w8a8_int8)
    reader = W8A8Int8Weights
