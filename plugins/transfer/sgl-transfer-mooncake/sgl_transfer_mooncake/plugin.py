"""Registers the ``mooncake`` KV transfer backend; imports nothing heavy.

Mooncake's engine (``mooncake.engine``, a native module) links against system libraries that
a Python install does not bring. Whether they load is checked here with ``ctypes`` (well under
a millisecond) instead of importing the engine: that import maps the whole engine into every
sgl process, costs about 0.1 s, and a native module that fails can take the process down
instead of raising.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["SGL_REQUIRES", "SGL_UNAVAILABLE", "sgl_register_kv_transfer_backends"]

SGL_REQUIRES = ["mooncake"]

#: the system libraries mooncake's engine needs beyond a base Debian, and their packages
SYSTEM_LIBRARIES = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1"}


def _unavailable() -> str | None:
    for library, package in SYSTEM_LIBRARIES.items():
        try:
            ctypes.CDLL(library)
        except OSError:
            return (f"mooncake's transfer engine needs {library}, which is not installed: "
                    f"install Debian's {package} (apt-get install {package})")
    return None


#: why the backend cannot run on this machine (None: it can)
SGL_UNAVAILABLE = _unavailable()


@hookimpl
def sgl_register_kv_transfer_backends(register: RegisterFn) -> None:
    register("mooncake", "sgl_transfer_mooncake.backend:MooncakeKVTransfer")
