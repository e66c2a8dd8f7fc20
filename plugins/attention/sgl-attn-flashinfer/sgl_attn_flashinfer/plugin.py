"""Registers the ``flashinfer`` attention backend; imports nothing heavy.

flashinfer runs on NVIDIA GPUs only, and its package (``flashinfer-python``) is installed only
where it can run: next to a CUDA build of torch. Whether the backend can run here is decided
without importing flashinfer (its import loads CUDA libraries and may compile kernels):

- flashinfer not installed: unavailable, with the pip line and whether this torch has CUDA at
  all (read from torch's ``version.py`` without importing torch);
- installed: torch is imported and ``torch.cuda.is_available()`` asked (it counts devices
  without creating a CUDA context, so ``torch.cuda.is_initialized()`` stays False).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sgl.hookspecs import hookimpl

if TYPE_CHECKING:
    from sgl.registry import RegisterFn

__all__ = ["SGL_UNAVAILABLE", "sgl_register_attention_backends"]

PIP = "pip install flashinfer-python (or the extra: pip install 'sgl-attn-flashinfer[flashinfer]')"


def torch_build() -> tuple[str | None, str | None]:
    """``(torch version, CUDA version it was built for)`` from torch's ``version.py``, without
    importing torch; ``(None, None)`` when torch is missing, CUDA None for a CPU build."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None, None

    def value(name: str) -> str | None:
        match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        return match.group(1) if match else None

    return value("__version__"), value("cuda")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def unavailable(*, flashinfer_installed: Callable[[], bool] | None = None,
                build: Callable[[], tuple[str | None, str | None]] = torch_build,
                cuda_available: Callable[[], bool] = _cuda_available) -> str | None:
    """Why the backend cannot run on this machine, with what to do; None when it can."""
    installed = (flashinfer_installed() if flashinfer_installed is not None
                 else importlib.util.find_spec("flashinfer") is not None)
    if not installed:
        version, cuda = build()
        if cuda is not None:
            return (f"flashinfer is not installed: {PIP}, a build for this torch's CUDA {cuda}, "
                    "on a machine with an NVIDIA GPU; without one use --attention-backend torch")
        return (f"flashinfer is not installed and torch {version or '(missing)'} has no CUDA: "
                "on a machine with an NVIDIA GPU, install a CUDA build of torch, then "
                f"{PIP} for that CUDA version; on CPU use --attention-backend torch")
    if not cuda_available():
        return ("flashinfer is installed but torch sees no CUDA device (no NVIDIA GPU or driver, "
                "or a CPU build of torch): use --attention-backend torch on this machine")
    return None


#: why the backend cannot run on this machine (None: it can)
SGL_UNAVAILABLE = unavailable()


@hookimpl
def sgl_register_attention_backends(register: RegisterFn) -> None:
    register("flashinfer", "sgl_attn_flashinfer.backend:FlashInferAttentionBackend")
