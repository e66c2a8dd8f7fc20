"""Model architectures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_model_archs(register: RegisterFn) -> None:
    """Register model classes under their Hugging Face ``architectures`` names.

    Call ``register("LlamaForCausalLM", "module:Class")``. The class follows
    :class:`sgl.models.BaseCausalLM`. Two plugins registering the same architecture is an error
    naming both.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """


@hookspec
def sgl_register_gguf_archs(register: RegisterFn) -> None:
    """Register the GGUF architectures (``general.architecture`` of a ``.gguf`` file) a model
    plugin loads, with how their tensors and config turn back into the Hugging Face ones.

    Call ``register("llama", "module:ATTR")``; the attribute is a
    :class:`sgl.model_loader.gguf_archs.GGUFArch` of that name: llama.cpp's per-layer tensor
    names, the converter's transforms to undo (interleaved q/k rows, a shift of the norms,
    fused or stacked tensors) and ``complete_config``, what the config needs beyond
    transformers' reading. A GGUF file of an architecture no plugin registers is refused with
    the list of those registered.

    :param register: ``register(name: str, target: str | object) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.2
    """


@hookspec
def sgl_register_weight_formats(register: RegisterFn) -> None:
    """Register checkpoint weight formats: Hugging Face checkpoints whose linear layers are
    stored quantized in a format of their own, named by ``quantization_config.quant_method``.

    Call ``register("gptq", "module:Class")``; the class subclasses
    :class:`sgl.model_loader.formats.WeightFormat` with that ``name``: it checks a
    checkpoint's settings and opens its weights, each quantized layer as one ``weight``.
    ``--quantization NAME`` serves only checkpoints of that format; ``auto`` picks it from
    ``config.json``.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def sgl_resolve_model_arch(hf_config: Any) -> str | None:
    """Claim a model whose ``architectures`` names no registered class.

    Stops at first non-None result.

    :param hf_config: the model's :class:`transformers.PretrainedConfig`.
    :return: the name of a registered architecture to run it with, or None to pass.

    Runs in: the scheduler process, while loading the model.

    .. versionadded:: 0.1
    """
