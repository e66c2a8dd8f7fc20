"""Weights of a Hugging Face model folder in PyTorch's pickle format: ``pytorch_model.bin``,
sharded or not (``pytorch_model.bin.index.json``), as many older checkpoints and most published
EAGLE heads come. Read with ``torch.load(weights_only=True)``: tensors only, no code runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.source import WeightSource, indexed_shards

__all__ = ["TorchBinWeights", "torch_bin_files"]

INDEX_FILE = "pytorch_model.bin.index.json"


def torch_bin_files(folder: Path) -> list[Path]:
    """The folder's ``pytorch_model*.bin`` files, in the index's order when there is one."""
    indexed = indexed_shards(folder, INDEX_FILE)
    return indexed if indexed is not None else sorted(folder.glob("pytorch_model*.bin"))


class TorchBinWeights(WeightSource):
    """Streams the tensors of each ``.bin`` file (memory-mapped where the file allows)."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        super().__init__(path, dtype)
        self.files = torch_bin_files(path)
        self._count: int | None = None

    def _load(self, file: Path) -> dict[str, torch.Tensor]:
        try:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # saved without the zip layout mmap needs
                state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle errors, truncated files, non-tensor objects
            raise ModelLoadError(f"cannot read weights file {str(file)!r} (corrupt, or not "
                                 f"a PyTorch state dict of tensors): {exc}") from exc
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor)
                                                  for t in state.values()):
            raise ModelLoadError(f"{str(file)!r} is not a state dict of named tensors")
        return state

    def __len__(self) -> int:
        if self._count is None:
            self._count = sum(len(self._load(f)) for f in self.files)
        return self._count

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            for name, tensor in self._load(file).items():
                yield name, self._cast(tensor)
