"""Speculative decoding algorithms."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_speculative_algorithms(register: RegisterFn) -> None:
    """Register speculative decoding algorithms (n-gram, draft model, ...) by name.

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.speculative.BaseSpeculativeAlgorithm`. Nothing runs it yet: sgl has no
    speculative decoding loop and no setting that selects an algorithm, so a registration is
    reported as not used (a warning, and a ``Not used:`` line in ``sgl plugins``).

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
