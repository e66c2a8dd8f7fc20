"""Registers the ``triton`` attention backend; imports nothing heavy (not even triton: the
core checks ``SGL_REQUIRES`` with ``importlib.util.find_spec``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["SGL_NOTE", "SGL_REQUIRES", "sgl_register_attention_backends"]

SGL_REQUIRES = ["triton"]

#: where the backend runs, for ``sgl plugins`` to show beside the plugin (the plugin stays
#: available on a CPU-only machine, where its backend refuses to start unless interpreted)
SGL_NOTE = ("--attention-backend triton runs on CUDA GPUs; on a CPU only under triton's "
            "interpreter (TRITON_INTERPRET=1), for testing")


@hookimpl
def sgl_register_attention_backends(register: RegisterFn) -> None:
    register("triton", "sgl_attn_triton.backend:TritonAttentionBackend")
