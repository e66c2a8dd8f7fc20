"""Parallelism strategies (tensor, data, pipeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_parallel_strategies(register: RegisterFn) -> None:
    """Register parallelism strategies by name (``tp``, ``dp``, ``pp``, ...).

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.parallel.BaseParallelStrategy`. It decides how many scheduler processes start and
    how weights are sharded among them. Nothing runs it yet: sgl starts exactly one scheduler
    process, so a registration is reported as not used (a warning, and a ``Not used:`` line in
    ``sgl plugins``).

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
