"""KV transfer backends for prefill/decode disaggregation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_kv_transfer_backends(register: RegisterFn) -> None:
    """Register backends that move KV cache between a prefill and a decode server.

    Call ``register(name, "module:Class")``; the class subclasses
    :class:`sgl.transfer.BaseKVTransfer`. ``--disaggregation-transfer-backend NAME`` selects
    it on a prefill and a decode server (``--disaggregation-mode``); each scheduler makes one
    instance over its KV pool, and the core's coordination calls it from its transfer thread.
    See docs/disaggregation.md.

    :param register: ``register(name: str, target: str | type) -> None``.
    :return: nothing.

    Runs in: every process, when the registries are built.

    .. versionadded:: 0.1
    """
