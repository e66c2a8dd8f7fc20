"""Registers the Llama architecture; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_gguf_archs", "sgl_register_model_archs"]


@hookimpl
def sgl_register_model_archs(register: RegisterFn) -> None:
    register("LlamaForCausalLM", "sgl_model_llama.model:LlamaForCausalLM")


@hookimpl
def sgl_register_gguf_archs(register: RegisterFn) -> None:
    register("llama", "sgl_model_llama.gguf:LLAMA")
