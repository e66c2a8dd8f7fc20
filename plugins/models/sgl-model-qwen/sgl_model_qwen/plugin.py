"""Registers the Qwen architectures; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["ARCHITECTURES", "sgl_register_gguf_archs", "sgl_register_model_archs"]

#: architecture name (``config.architectures``) -> "module:Class"
ARCHITECTURES = {
    "Qwen2ForCausalLM": "sgl_model_qwen.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sgl_model_qwen.qwen3:Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "sgl_model_qwen.qwen2_moe:Qwen2MoeForCausalLM",
}


@hookimpl
def sgl_register_model_archs(register: RegisterFn) -> None:
    for name, target in ARCHITECTURES.items():
        register(name, target)


@hookimpl
def sgl_register_gguf_archs(register: RegisterFn) -> None:
    register("qwen2", "sgl_model_qwen.gguf:QWEN2")
    register("qwen2moe", "sgl_model_qwen.gguf:QWEN2MOE")
    register("qwen3", "sgl_model_qwen.gguf:QWEN3")
