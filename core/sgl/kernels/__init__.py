"""Native kernels for hot paths that torch's own operators leave slow (see :mod:`.cpu`)."""

from __future__ import annotations

__all__: list[str] = []
