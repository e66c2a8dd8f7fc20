"""Cache policies: what finished prefixes stay in KV memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_cache_policies(register: RegisterFn) -> None:
    """Register prefix-cache policies (for example the radix cache) by name.

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.kvcache.BaseCachePolicy` and is chosen with ``--cache-policy NAME``. Without any
    policy the core caches nothing across requests.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
