"""Registers the Mistral architecture; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_model_archs"]


@hookimpl
def sgl_register_model_archs(register: RegisterFn) -> None:
    register("MistralForCausalLM", "sgl_model_mistral.model:MistralForCausalLM")
