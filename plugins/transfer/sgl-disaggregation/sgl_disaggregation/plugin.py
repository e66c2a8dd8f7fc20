"""Registers the prefill and the decode side of disaggregation; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_scheduler_extensions"]


@hookimpl
def sgl_register_scheduler_extensions(register: RegisterFn) -> None:
    register("disaggregation-prefill", "sgl_disaggregation.prefill:PrefillSide")
    register("disaggregation-decode", "sgl_disaggregation.decode:DecodeSide")
