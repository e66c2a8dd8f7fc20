"""Native kernel libraries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_kernel_libraries(register: RegisterFn) -> None:
    """Register native kernel libraries by device type.

    Call ``register(device_type, "module:Class")``: ``"cpu"`` for a library of CPU kernels. The
    class subclasses :class:`sgl.kernels.library.KernelLibrary`. Importing its module loads the
    compiled kernels, which implement the ``torch.ops.sgl`` operators of
    :mod:`sgl.kernels.ops` for that device (``TORCH_LIBRARY_IMPL(sgl, CPU, m)``); the class
    holds the controls the core needs besides them (instruction-set level, threads, recording
    and replay). It is built the first time a layer could call a kernel; where it cannot run
    (its compiled part is missing) its constructor raises
    :class:`sgl.kernels.library.KernelLibraryUnavailable` with the reason, and the layers run
    their torch code. Registering a device type another plugin already took is an error naming
    both plugins.

    :param register: ``register(device_type: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process that runs a model, when the registries are built (never per batch).

    .. versionadded:: 0.2
    """
