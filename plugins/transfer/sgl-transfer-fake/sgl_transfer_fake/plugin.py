"""Registers the ``fake`` KV transfer backend; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_kv_transfer_backends"]


@hookimpl
def sgl_register_kv_transfer_backends(register: RegisterFn) -> None:
    register("fake", "sgl_transfer_fake.backend:FakeKVTransfer")
