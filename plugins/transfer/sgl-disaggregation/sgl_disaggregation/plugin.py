"""Registers the prefill and the decode side of disaggregation and their options; imports
nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.config import ServerSettings
    from sgl.plugins import Registries
    from sgl.registry import RegisterFn

__all__ = ["sgl_add_config", "sgl_check_settings", "sgl_register_scheduler_extensions"]


@hookimpl
def sgl_add_config() -> type:
    from sgl_disaggregation.settings import DisaggregationSettings

    return DisaggregationSettings


@hookimpl
def sgl_check_settings(settings: ServerSettings, registries: Registries) -> None:
    from sgl_disaggregation.settings import check

    check(settings, registries)


@hookimpl
def sgl_register_scheduler_extensions(register: RegisterFn) -> None:
    register("disaggregation-prefill", "sgl_disaggregation.prefill:PrefillSide")
    register("disaggregation-decode", "sgl_disaggregation.decode:DecodeSide")
