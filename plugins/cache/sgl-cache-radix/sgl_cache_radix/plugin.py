"""Registers the ``radix`` cache policy; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_cache_policies"]


@hookimpl
def sgl_register_cache_policies(register: RegisterFn) -> None:
    register("radix", "sgl_cache_radix.radix_cache:RadixCache")
