"""Weights of a Hugging Face model folder: ``*.safetensors``, sharded or not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.source import WeightSource, indexed_shards

__all__ = ["SafetensorsWeights"]

INDEX_FILE = "model.safetensors.index.json"


def _shard_files(folder: Path) -> list[Path]:
    indexed = indexed_shards(folder, INDEX_FILE)
    if indexed is not None:
        return indexed
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        found = f" (found {', '.join(others)}, which sgl does not read)" if others else ""
        raise ModelLoadError(
            f"no weights found in model folder {str(folder)!r}{found}; supported formats: "
            "*.safetensors (optionally sharded with model.safetensors.index.json), "
            "pytorch_model*.bin, or a .gguf file"
        )
    return files


class SafetensorsWeights(WeightSource):
    """Streams tensors file by file through ``safetensors.safe_open`` (memory-mapped)."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        super().__init__(path, dtype)
        self.files = _shard_files(path)
        self._count: int | None = None

    def _open(self, file: Path) -> Any:  # safetensors' handle has no public type
        from safetensors import safe_open

        try:
            return safe_open(str(file), framework="pt")
        except Exception as exc:  # SafetensorError, OSError
            raise ModelLoadError(
                f"cannot read weights file {str(file)!r} (corrupt or not safetensors): {exc}"
            ) from exc

    def __len__(self) -> int:
        if self._count is None:
            count = 0
            for file in self.files:
                with self._open(file) as handle:
                    count += len(list(handle.keys()))
            self._count = count
        return self._count

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with self._open(file) as handle:
                for name in handle.keys():
                    try:
                        tensor = handle.get_tensor(name)
                    except Exception as exc:
                        raise ModelLoadError(
                            f"cannot read tensor {name!r} from {str(file)!r}: {exc}"
                        ) from exc
                    yield name, self._cast(tensor)
