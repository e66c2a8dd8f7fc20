"""Registers the GPTQ, AWQ and compressed-tensors weight formats; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_weight_formats"]


@hookimpl
def sgl_register_weight_formats(register: RegisterFn) -> None:
    register("compressed-tensors", "sgl_quant_packed.formats:CompressedTensors")
    register("gptq", "sgl_quant_packed.formats:GPTQ")
    register("awq", "sgl_quant_packed.formats:AWQ")
