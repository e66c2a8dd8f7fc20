"""Scheduler extensions: optional participants in the scheduler's steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_scheduler_extensions(register: RegisterFn) -> None:
    """Register scheduler extensions by name: features that take part in the scheduler's steps
    (prefill/decode disaggregation, a trace recorder, a per-request budget).

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.engine.extension.SchedulerExtension`, whose hooks (a new request's check, the
    start and end of a step, the batch's forward and results, a request's end) all do nothing
    unless overridden. Each scheduler makes one instance of every registered class whose
    ``enabled(settings)`` is true, after the core's own (speculative decoding), in the
    plugins' call order; the instance sees the scheduler through a
    :class:`~sgl.engine.extension.SchedulerView`. docs/scheduler-extensions.md describes the
    contract whole, with an example plugin.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.2
    """
