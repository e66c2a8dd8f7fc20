"""KV transfer: the base class transfer plugins implement."""

from __future__ import annotations

from sgl.transfer.base import BaseKVTransfer, KVBuffers, KVTransferError, Role, slot_runs

__all__ = ["BaseKVTransfer", "KVBuffers", "KVTransferError", "Role", "slot_runs"]
