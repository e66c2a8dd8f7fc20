"""Finding and reading models: config, weights and tokenizer, from a folder or a GGUF file.

Attributes are imported on first access, so ``from sgl.model_loader import
bundled_model_path`` does not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl.model_loader.config import load_hf_config
    from sgl.model_loader.errors import ModelLoadError
    from sgl.model_loader.gguf_weights import GGUFWeights, gguf_to_hf_name
    from sgl.model_loader.paths import bundled_model_path, is_gguf, resolve_model_path
    from sgl.model_loader.safetensors_weights import SafetensorsWeights
    from sgl.model_loader.source import WeightSource
    from sgl.model_loader.tokenizer import load_tokenizer
    from sgl.model_loader.torch_bin_weights import TorchBinWeights
    from sgl.model_loader.weights import iter_weights, open_weights

__all__ = [
    "GGUFWeights",
    "ModelLoadError",
    "SafetensorsWeights",
    "TorchBinWeights",
    "WeightSource",
    "bundled_model_path",
    "gguf_to_hf_name",
    "is_gguf",
    "iter_weights",
    "load_hf_config",
    "load_tokenizer",
    "open_weights",
    "resolve_model_path",
]

_HOME = {
    "GGUFWeights": "gguf_weights",
    "ModelLoadError": "errors",
    "SafetensorsWeights": "safetensors_weights",
    "TorchBinWeights": "torch_bin_weights",
    "WeightSource": "source",
    "bundled_model_path": "paths",
    "gguf_to_hf_name": "gguf_weights",
    "is_gguf": "paths",
    "iter_weights": "weights",
    "load_hf_config": "config",
    "load_tokenizer": "tokenizer",
    "open_weights": "weights",
    "resolve_model_path": "paths",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
