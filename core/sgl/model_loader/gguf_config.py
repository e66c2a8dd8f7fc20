"""A GGUF file's metadata, and the config fields transformers' GGUF reader leaves out of it.

transformers (``integrations/ggml.py``) maps the common keys: sizes, heads, epsilon, rope base,
expert counts, some sliding windows. :func:`complete_common` adds the rest for every
architecture: ``head_dim`` from ``attention.key_length``, attention/MLP biases by the presence
of their tensors, linear (and, to be refused by name, YaRN) rope scaling, and ``rope_freqs``
(the frequency divisors llama.cpp's converter computes from ``llama3``-type rope scaling) back
into those rope parameters; then
:meth:`GGUFArch.complete <sgl.model_loader.gguf_archs.GGUFArch.complete>` adds what the
architecture's own ``complete_config`` (a model plugin's) does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from sgl.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PretrainedConfig

__all__ = ["GGUFMetadata", "complete_common", "head_dim_of", "read_gguf",
           "rope_from_freq_factors", "update_rope"]


def read_gguf(path: Path) -> Any:
    """A memory-mapped ``gguf.GGUFReader`` of ``path``.

    :raises ModelLoadError: when the file is not GGUF."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # ValueError (bad magic), struct errors, OSError
        raise ModelLoadError(
            f"cannot read GGUF file {str(path)!r} (corrupt or not GGUF): {exc}"
        ) from exc


class GGUFMetadata:
    """The key/value fields and small tensors of an open ``gguf.GGUFReader``."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch = str(self.get("general.architecture") or "")
        self._tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field_ = self.reader.fields.get(key)
        return default if field_ is None else field_.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        """``{arch}.{key}``, e.g. ``attention.head_count``."""
        return self.get(f"{self.arch}.{key}", default)

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """The torch-order shape of tensor ``name`` (GGUF stores it innermost first)."""
        tensor = self._tensors.get(name)
        return None if tensor is None else tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def tensor_values(self, name: str) -> np.ndarray | None:
        """Tensor ``name`` dequantized to a flat float64 array (for the small config tensors)."""
        from gguf.quants import dequantize

        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)


def head_dim_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None)
               or config.hidden_size // config.num_attention_heads)


def update_rope(config: PretrainedConfig, params: dict[str, Any],
                 layer_type: str = "full_attention") -> None:
    """Merge ``params`` into ``config.rope_parameters`` (into its ``layer_type`` entry when it
    holds one per layer type)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in rope:
        rope[layer_type] = {**(rope.get(layer_type) or rope["full_attention"]), **params}
    else:
        rope.update(params)
    config.rope_parameters = rope


def rope_from_freq_factors(factors: np.ndarray, theta: float,
                           rotary_dim: int) -> dict[str, Any] | None:
    """The rope parameters (of transformers' ``llama3`` rope type) whose frequency divisors
    are ``factors`` (the ``rope_freqs`` tensor llama.cpp's converter computes from them); None
    when every factor is 1. Only the ratios ``original / low_freq_factor`` and ``original /
    high_freq_factor`` are determined by the factors, so ``low_freq_factor`` is taken as 1.

    :raises ModelLoadError: when the factors are not of that form (then sgl cannot apply them).
    """
    f = np.asarray(factors, np.float64)
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(f.max())
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    inv_wavelen = inv_freq / (2 * math.pi)
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    params: dict[str, Any] | None = None
    if len(f) == len(inv_freq) and band.sum() >= 2:
        # in the band 1/f = (1 - s)/factor + s with s = (original/wavelen - low)/(high - low)
        smooth = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[band], smooth, 1)
        if intercept < 0 < slope:
            high = 1 - 1 / intercept
            original = -slope / intercept
            if abs(original - round(original)) < 1e-3 * original:
                original = round(original)
            params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": float(high),
                      "original_max_position_embeddings": original}
    if params is None or not np.allclose(_freq_factors(inv_freq, params), f, rtol=1e-4,
                                         atol=0):
        raise ModelLoadError(
            "the GGUF file's rope_freqs.weight is not llama3-type rope scaling (or has fewer than "
            "two frequencies between its long and short wavelengths); sgl applies rope frequency "
            "factors only in that form (supported rope types: default, linear, llama3, longrope)")
    return params


def _freq_factors(inv_freq: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """The divisors of ``inv_freq`` that ``llama3``-type scaling with ``params`` applies."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, scaled))


# -- what every architecture adds to transformers' config -----------------------------------

def complete_common(meta: GGUFMetadata, config: PretrainedConfig,
                    fixed_attention_bias: bool = False) -> None:
    """What every architecture's config gets: ``head_dim``, the optional biases (attention
    biases unless ``fixed_attention_bias``), rope scaling (and ``rope_freqs``)."""
    key_length = meta.arch_get("attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    if not fixed_attention_bias:
        config.attention_bias = meta.tensor_shape("blk.0.attn_q.bias") is not None
    if meta.tensor_shape("blk.0.ffn_down.bias") is not None:
        config.mlp_bias = True
    scaling = str(meta.arch_get("rope.scaling.type") or "none")
    factor = meta.arch_get("rope.scaling.factor")
    if scaling == "linear" and factor:
        update_rope(config, {"rope_type": "linear", "factor": float(factor)})
    elif scaling == "yarn":  # sgl's rope refuses it by name; better than running without it
        params = {"rope_type": "yarn", "factor": float(factor or 1.0)}
        original = meta.arch_get("rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
        update_rope(config, params)
    freqs = meta.tensor_values("rope_freqs.weight")
    if freqs is not None:
        theta = float(meta.arch_get("rope.freq_base") or 10000.0)
        rotary_dim = int(meta.arch_get("rope.dimension_count") or head_dim_of(config))
        params = rope_from_freq_factors(freqs, theta, rotary_dim)
        if params is not None:
            update_rope(config, params)


