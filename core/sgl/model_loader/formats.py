"""Checkpoint weight formats: Hugging Face checkpoints whose linear layers are stored quantized
in a format of their own (packed integers with scales and zero points), named by the
``quant_method`` of ``config.json``'s ``quantization_config``.

A plugin registers each format it reads with ``sgl_register_weight_formats`` (docs/hooks.md): a
:class:`WeightFormat` subclass that checks a checkpoint's settings and opens its weights as a
:class:`~sgl.model_loader.source.WeightSource`, each quantized layer yielded as one ``weight``
(:class:`~sgl.layers.quantized.QuantizedTensor` blocks where sgl runs them, else dense).
``--quantization`` takes the registered names besides the core's own (:data:`CORE_CHOICES`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from sgl.model_loader.source import WeightSource

__all__ = ["CORE_CHOICES", "ROUNDING_CHOICES", "WeightFormat", "installed_weight_formats", "weight_formats_of"]

#: the ``--quantization`` values of the core: ``auto`` (as the checkpoint is stored), ``none``
#: (dense), ``gguf`` (a GGUF file's blocks), ``int8``/``int4``/``w8a8_int8`` (round a dense
#: checkpoint: to blocks, weight-only; or per channel with int8 activations, SGLang's scheme)
CORE_CHOICES = ("auto", "none", "gguf", "int8", "int4", "w8a8_int8")
#: the choices that round a dense checkpoint's weights at load
ROUNDING_CHOICES = ("int8", "int4", "w8a8_int8")


class WeightFormat(ABC):
    """One checkpoint format (see the module docstring)."""

    #: the ``quant_method`` of its checkpoints, and its ``--quantization`` name
    name: ClassVar[str]
    #: the format with its article, for messages: ``"a GPTQ"``
    description: ClassVar[str]
    #: files an older checkpoint keeps its ``quantization_config`` in when ``config.json`` has
    #: none (AutoGPTQ's ``quantize_config.json``)
    settings_files: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check(cls, quant: dict[str, Any], name: str) -> None:
        """ValueError naming what sgl cannot run in checkpoint ``name`` whose
        ``quantization_config`` is ``quant``; nothing where it can."""

    @classmethod
    @abstractmethod
    def open(cls, path: Path, dtype: torch.dtype, quant: dict[str, Any], *,
             quantized: bool) -> WeightSource:
        """The weights of the checkpoint folder ``path``: quantized layers as blocks when
        ``quantized`` (and sgl runs them), else dense; floating-point tensors in ``dtype``."""


def weight_formats_of(registries: Any) -> dict[str, type[WeightFormat]]:
    """The formats the plugins of ``registries`` registered, by name; ValueError for an entry
    that is not a :class:`WeightFormat` of that name."""
    formats = {}
    for entry in registries.weight_formats:
        cls = entry.load()
        if not (isinstance(cls, type) and issubclass(cls, WeightFormat)) \
                or cls.name != entry.name:
            raise ValueError(f"plugin {entry.owner!r} registered weight format {entry.name!r} "
                             f"as {cls!r}, not a WeightFormat of that name")
        formats[entry.name] = cls
    return formats


def installed_weight_formats() -> dict[str, type[WeightFormat]]:
    """The formats of the installed plugins (:func:`sgl.plugins.installed_plugin_manager`), for
    a caller that has no registries of its own."""
    from sgl.plugins import installed_plugin_manager

    return weight_formats_of(installed_plugin_manager().registries)
