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
    :class:`sgl.speculative.BaseSpeculativeAlgorithm` and only drafts tokens: the engine
    verifies them in one target forward and keeps what the target would have produced
    (:mod:`sgl.engine.speculative`). ``--speculative-algorithm NAME`` selects one.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
