"""Registers the GPTQ, AWQ, compressed-tensors and w8a8_int8 weight formats; imports nothing
heavy."""

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
    register("w8a8_int8", "sgl_quant_packed.formats:W8A8Int8")
