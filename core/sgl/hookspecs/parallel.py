"""Parallelism strategies (tensor, data, pipeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_parallel_strategies(register: RegisterFn) -> None:
    """Register parallelism strategies by name (``tp``, ``pp``, ...).

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.parallel.BaseParallelStrategy`. The core asks every registered class
    ``from_settings(settings)``; the one strategy the settings turn on decides which scheduler
    processes (ranks) start on this machine, joins them in each (``init_process``), gives the
    leader's model runner a mirror (``lead``) and runs the other ranks (``follow``). See
    docs/parallelism.md.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
