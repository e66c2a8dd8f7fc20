"""Registers the ``triton`` attention backend; imports nothing heavy (not even triton: the
core checks ``SGL_REQUIRES`` with ``importlib.util.find_spec``).

The plugin stays available on a machine without a GPU, where the backend refuses to start
unless triton's interpreter is on; ``SGL_NOTE`` says where it runs. Whether this machine has
NVIDIA's driver is checked by loading ``libcuda.so.1`` with ``ctypes`` (well under a
millisecond, and it initialises nothing), not by importing torch.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["SGL_NOTE", "SGL_REQUIRES", "sgl_register_attention_backends"]

SGL_REQUIRES = ["triton"]


def _where_it_runs() -> str:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ("runs on CUDA GPUs; this machine has no CUDA driver (libcuda.so.1), so here "
                "only under triton's interpreter (TRITON_INTERPRET=1), for testing")
    return ("runs on CUDA GPUs (--device cuda); on a CPU only under triton's interpreter "
            "(TRITON_INTERPRET=1), for testing")


#: where the backend runs, for ``sgl plugins`` to show beside the plugin
SGL_NOTE = _where_it_runs()


@hookimpl
def sgl_register_attention_backends(register: RegisterFn) -> None:
    register("triton", "sgl_attn_triton.backend:TritonAttentionBackend")
