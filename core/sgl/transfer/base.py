"""The interface of KV transfer backends (prefill/decode disaggregation)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BaseKVTransfer"]


class BaseKVTransfer(ABC):
    """Moves the KV of a prefilled request from a prefill server to a decode server."""

    @abstractmethod
    def send(self, rid: str, layers_k: list[torch.Tensor], layers_v: list[torch.Tensor]) -> None:
        """Prefill side: hand over the KV of request ``rid``."""

    @abstractmethod
    def receive(self, rid: str, timeout: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Decode side: wait for the KV of request ``rid``."""
