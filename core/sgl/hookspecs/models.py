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


@hookspec(firstresult=True)
def sgl_resolve_model_arch(hf_config: Any) -> str | None:
    """Claim a model whose ``architectures`` names no registered class.

    Stops at first non-None result.

    :param hf_config: the model's :class:`transformers.PretrainedConfig`.
    :return: the name of a registered architecture to run it with, or None to pass.

    Runs in: the scheduler process, while loading the model.

    .. versionadded:: 0.1
    """
