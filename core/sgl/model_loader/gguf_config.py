"""A GGUF file's metadata, and the config fields transformers' GGUF reader leaves out of it.

transformers (``integrations/ggml.py``) maps the common keys: sizes, heads, epsilon, rope base,
expert counts, Gemma's sliding window. :func:`complete_config` adds the rest, per architecture:

* every one: ``head_dim`` from ``attention.key_length``; attention/MLP biases by the presence of
  their tensors; linear (and, to be refused by name, YaRN) rope scaling; ``rope_freqs``, which
  llama.cpp's converter computes from Llama 3 rope scaling, back into ``rope_type: llama3``;
* ``llama``: no sliding window unless the file names one (transformers' MistralConfig would
  default to 4096; llama.cpp attends to the whole context);
* ``qwen2moe``: the routed and shared experts' sizes;
* ``gemma2``/``gemma3``: llama.cpp's attention scale (``query_pre_attn_scalar``: ``hidden /
  heads`` for the 27B models, else ``head_dim``), the soft-caps; Gemma 3's local rope base and
  sliding-window pattern;
* ``phi3``: partial rotary (``rope.dimension_count`` of ``head_dim``), the sliding window (0:
  none), LongRoPE from the ``rope_factors_long``/``rope_factors_short`` tensors.
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

__all__ = ["GGUFMetadata", "complete_config", "llama3_rope_from_factors", "read_gguf"]


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


def _head_dim(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None)
               or config.hidden_size // config.num_attention_heads)


def _update_rope(config: PretrainedConfig, params: dict[str, Any],
                 layer_type: str = "full_attention") -> None:
    """Merge ``params`` into ``config.rope_parameters`` (into its ``layer_type`` entry when it
    holds one per layer type, as Gemma 3's does)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in rope:
        rope[layer_type] = {**(rope.get(layer_type) or rope["full_attention"]), **params}
    else:
        rope.update(params)
    config.rope_parameters = rope


def llama3_rope_from_factors(factors: np.ndarray, theta: float,
                             rotary_dim: int) -> dict[str, Any] | None:
    """The ``llama3`` rope parameters whose frequency divisors are ``factors`` (the
    ``rope_freqs`` tensor llama.cpp's converter computes from them); None when every factor is
    1. Only the ratios ``original / low_freq_factor`` and ``original / high_freq_factor`` are
    determined by the factors, so ``low_freq_factor`` is taken as 1.

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
    if params is None or not np.allclose(_llama3_factors(inv_freq, params), f, rtol=1e-4,
                                         atol=0):
        raise ModelLoadError(
            "the GGUF file's rope_freqs.weight is not Llama 3 rope scaling (or has fewer than two "
            "frequencies between its long and short wavelengths); sgl applies rope frequency "
            "factors only in that form (supported rope types: default, linear, llama3, longrope)")
    return params


def _llama3_factors(inv_freq: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """The divisors of ``inv_freq`` that Llama 3 scaling with ``params`` applies."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, scaled))


# -- what each architecture adds to transformers' config ------------------------------------

def _common(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    """``head_dim``, optional biases, rope scaling (and ``rope_freqs``) for any architecture."""
    key_length = meta.arch_get("attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    if meta.arch not in ("qwen2", "qwen2moe"):  # whose q/k/v biases are not optional
        config.attention_bias = meta.tensor_shape("blk.0.attn_q.bias") is not None
    if meta.tensor_shape("blk.0.ffn_down.bias") is not None:
        config.mlp_bias = True
    scaling = str(meta.arch_get("rope.scaling.type") or "none")
    factor = meta.arch_get("rope.scaling.factor")
    if scaling == "linear" and factor:
        _update_rope(config, {"rope_type": "linear", "factor": float(factor)})
    elif scaling == "yarn":  # sgl's rope refuses it by name; better than running without it
        params = {"rope_type": "yarn", "factor": float(factor or 1.0)}
        original = meta.arch_get("rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
        _update_rope(config, params)
    freqs = meta.tensor_values("rope_freqs.weight")
    if freqs is not None:
        theta = float(meta.arch_get("rope.freq_base") or 10000.0)
        rotary_dim = int(meta.arch_get("rope.dimension_count") or _head_dim(config))
        params = llama3_rope_from_factors(freqs, theta, rotary_dim)
        if params is not None:
            _update_rope(config, params)


def _llama(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    """Mistral files are ``llama`` to llama.cpp, which attends to the whole context unless the
    file names a window; transformers' MistralConfig would default to 4096."""
    _common(meta, config)
    window = meta.arch_get("attention.sliding_window")
    if config.model_type == "mistral" or window is not None:
        config.sliding_window = int(window) if window else None


def _qwen2moe(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    _common(meta, config)
    routed = meta.tensor_shape("blk.0.ffn_gate_exps.weight")
    shared = meta.tensor_shape("blk.0.ffn_gate_shexp.weight")
    config.moe_intermediate_size = int(meta.arch_get("expert_feed_forward_length")
                                       or (routed[1] if routed else 0))
    config.shared_expert_intermediate_size = int(
        meta.arch_get("expert_shared_feed_forward_length") or (shared[0] if shared else 0))


def _gemma(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    _common(meta, config)
    # llama.cpp's attention scale: 1/sqrt(hidden / heads) for the 27B models (by layer count),
    # else 1/sqrt(head_dim)
    big = {"gemma2": 46, "gemma3": 62}[meta.arch]
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                    if config.num_hidden_layers == big else _head_dim(config))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.arch_get(key)
        if value is not None:
            setattr(config, key, float(value) or None)
    if meta.arch != "gemma3":
        return
    local_theta = float(meta.arch_get("rope.freq_base_swa") or 10000.0)
    if "full_attention" in (getattr(config, "rope_parameters", None) or {}):
        _update_rope(config, {"rope_type": "default", "rope_theta": local_theta},
                     "sliding_attention")
    else:
        config.rope_local_base_freq = local_theta
    pattern = meta.arch_get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True = sliding window
        config.layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        config.sliding_window_pattern = int(pattern)
        config.layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                              for i in range(config.num_hidden_layers)]


def _phi3(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    _common(meta, config)
    params: dict[str, Any] = {}
    rope_dims = meta.arch_get("rope.dimension_count")
    if rope_dims and int(rope_dims) != _head_dim(config):
        params["partial_rotary_factor"] = int(rope_dims) / _head_dim(config)
    window = meta.arch_get("attention.sliding_window")
    if window is not None:  # 0: none (Phi-4-mini)
        config.sliding_window = int(window) or None
    original = meta.arch_get("rope.scaling.original_context_length")
    if original:
        config.original_max_position_embeddings = int(original)
    long = meta.tensor_values("rope_factors_long.weight")
    short = meta.tensor_values("rope_factors_short.weight")
    if long is not None and short is not None:
        params.update(rope_type="longrope", long_factor=long.tolist(),
                      short_factor=short.tolist(),
                      original_max_position_embeddings=int(original or
                                                           config.max_position_embeddings))
        attn_factor = meta.arch_get("rope.scaling.attn_factor")
        if attn_factor:
            params["attention_factor"] = float(attn_factor)
    if params:
        _update_rope(config, params)


_BY_ARCH: dict[str, Callable[[GGUFMetadata, PretrainedConfig], None]] = {
    "llama": _llama, "qwen2moe": _qwen2moe, "gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3}


def complete_config(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    """Add to ``config`` (transformers' reading of the file) what the metadata says and
    transformers left out, for the file's architecture (see the module docstring)."""
    _BY_ARCH.get(meta.arch, _common)(meta, config)
