"""KV transfer: the base class transfer plugins implement."""

from __future__ import annotations

from sgl.transfer.base import BaseKVTransfer

__all__ = ["BaseKVTransfer"]
