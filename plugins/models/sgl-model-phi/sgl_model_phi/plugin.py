"""Registers the Phi-3 architecture (Phi-3, Phi-3.5, Phi-4-mini); imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_gguf_archs", "sgl_register_model_archs"]


@hookimpl
def sgl_register_model_archs(register: RegisterFn) -> None:
    register("Phi3ForCausalLM", "sgl_model_phi.model:Phi3ForCausalLM")


@hookimpl
def sgl_register_gguf_archs(register: RegisterFn) -> None:
    register("phi3", "sgl_model_phi.gguf:PHI3")
