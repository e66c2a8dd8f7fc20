"""The common shape of a weight source: a sized, re-iterable stream of named tensors."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["WeightSource", "indexed_shards"]


def indexed_shards(folder: Path, index_name: str) -> list[Path] | None:
    """The shard files a checkpoint's index (``index_name``: its ``weight_map`` of tensor ->
    file) lists, in order; None without an index. :class:`ModelLoadError` for an unreadable
    index or a missing shard."""
    from sgl.model_loader.errors import ModelLoadError

    index = folder / index_name
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the shard index {str(index)!r}: {exc}") from exc
    files = [folder / name for name in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{str(index)!r} lists shards that are missing from the folder: "
                             f"{', '.join(missing)}")
    return files


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
