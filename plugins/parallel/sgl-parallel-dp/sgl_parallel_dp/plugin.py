"""Registers the ``dp`` parallel strategy and its option; imports nothing heavy."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_parallel_strategies(register: Any) -> None:
    register("dp", "sgl_parallel_dp.strategy:DataParallel")


@hookimpl
def sgl_add_config() -> type:
    from sgl_parallel_dp.settings import DataParallelSettings

    return DataParallelSettings


@hookimpl
def sgl_check_settings(settings: Any) -> None:
    from sgl_parallel_dp.settings import check

    check(settings)
