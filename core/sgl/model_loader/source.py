"""The common shape of a weight source: a sized, re-iterable stream of named tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["WeightSource"]


class WeightSource(ABC):
    """Tensors of one checkpoint under their Hugging Face names, read one at a time.

    ``len(source)`` is the number of tensors :meth:`__iter__` yields (for progress bars);
    iterating again re-reads from disk. Floating-point tensors are cast to ``dtype``.
    """

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        self.path = path
        self.dtype = dtype

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor
