"""Registers the ``dp`` parallel strategy; imports nothing heavy."""

from __future__ import annotations

from typing import Any

from sgl import hookimpl


@hookimpl
def sgl_register_parallel_strategies(register: Any) -> None:
    register("dp", "sgl_parallel_dp.strategy:DataParallel")
