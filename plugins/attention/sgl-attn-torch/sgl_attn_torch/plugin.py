"""Registers the ``torch`` attention backend; imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["sgl_register_attention_backends"]


@hookimpl
def sgl_register_attention_backends(register: RegisterFn) -> None:
    register("torch", "sgl_attn_torch.backend:TorchAttentionBackend")
