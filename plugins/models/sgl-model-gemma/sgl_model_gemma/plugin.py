"""Registers the Gemma 2 and Gemma 3 (text) architectures; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_gguf_archs", "sgl_register_model_archs"]


@hookimpl
def sgl_register_model_archs(register: RegisterFn) -> None:
    register("Gemma2ForCausalLM", "sgl_model_gemma.model:Gemma2ForCausalLM")
    register("Gemma3ForCausalLM", "sgl_model_gemma.model:Gemma3ForCausalLM")


@hookimpl
def sgl_register_gguf_archs(register: RegisterFn) -> None:
    register("gemma2", "sgl_model_gemma.gguf:GEMMA2")
    register("gemma3", "sgl_model_gemma.gguf:GEMMA3")
