"""Registers the CPU kernel library; imports nothing heavy (the kernels load on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_kernel_libraries"]


@hookimpl
def sgl_register_kernel_libraries(register: RegisterFn) -> None:
    register("cpu", "sgl_kernels_cpu.library:CpuKernelLibrary")
