"""Attention backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_attention_backends(register: RegisterFn) -> None:
    """Register attention backends by name.

    Call ``register(name, "module:Class")`` once per backend. The class subclasses
    :class:`sgl.attention.BaseAttentionBackend`; it is imported only when
    ``--attention-backend NAME`` selects it. Registering a name another plugin already took is an
    error naming both plugins.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built (never per batch).

    .. versionadded:: 0.1
    """
