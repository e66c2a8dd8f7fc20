"""sgl's CPU kernels as torch operators (see :mod:`sgl_kernels_cpu.library`)."""

from __future__ import annotations

__all__: list[str] = []
