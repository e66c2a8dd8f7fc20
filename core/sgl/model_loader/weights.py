"""Choosing the weight reader for a model path."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from sgl.model_loader.config import quantization_config
from sgl.model_loader.formats import WeightFormat, installed_weight_formats
from sgl.model_loader.gguf_archs import GGUFArch
from sgl.model_loader.gguf_weights import GGUFWeights
from sgl.model_loader.paths import is_gguf, resolve_model_path
from sgl.model_loader.safetensors_weights import SafetensorsWeights
from sgl.model_loader.source import WeightSource
from sgl.model_loader.torch_bin_weights import TorchBinWeights, torch_bin_files

__all__ = ["iter_weights", "open_weights"]


def open_weights(path: str | Path | None, dtype: torch.dtype = torch.float32, *,
                 quantized: bool = False,
                 gguf_archs: Mapping[str, GGUFArch] | None = None,
                 weight_formats: Mapping[str, type[WeightFormat]] | None = None) -> WeightSource:
    """A sized stream of ``(hf_name, tensor)`` for a model folder or ``.gguf`` file.

    :param path: as for :func:`~sgl.model_loader.resolve_model_path` (None: the bundled model).
    :param dtype: floating-point tensors are cast to this dtype.
    :param quantized: a GGUF file's quantized blocks, and the quantized layers of a checkpoint
        in a registered weight format (by its ``quant_method``), come as
        :class:`~sgl.layers.quantized.QuantizedTensor` where sgl runs them (else dequantized).
    :param gguf_archs: the GGUF architectures the plugins registered (None: the installed
        plugins').
    :param weight_formats: the checkpoint formats the plugins registered (None: the installed
        plugins').
    :raises ModelLoadError: missing path, no weights, corrupt file.
    """
    resolved = resolve_model_path(path)
    if is_gguf(resolved):
        return GGUFWeights(resolved, dtype, quantized=quantized, gguf_archs=gguf_archs)
    if not any(resolved.glob("*.safetensors")) and torch_bin_files(resolved):
        return TorchBinWeights(resolved, dtype)
    formats = installed_weight_formats() if weight_formats is None else weight_formats
    quant = quantization_config(resolved, formats) or {}
    fmt = formats.get(str(quant.get("quant_method", "")).lower())
    if fmt is not None:
        return fmt.open(resolved, dtype, quant, quantized=quantized)
    return SafetensorsWeights(resolved, dtype)


def iter_weights(path: str | Path | None,
                 dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the tensors one by one under Hugging Face names (see :func:`open_weights`)."""
    return iter(open_weights(path, dtype))
