"""What a Gemma config says about each layer: local (sliding-window) or global attention, and
the rotary embedding of each kind of layer.

Transformers >= 5 writes ``layer_types`` and per-layer-type ``rope_parameters`` into every Gemma
2/3 config; older Gemma 3 configs carry ``sliding_window_pattern`` and ``rope_local_base_freq``
instead, and older Gemma 2 configs nothing (every other layer is local, starting with layer 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.layers import RotaryEmbedding, get_rope, rope_parameters

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["LAYER_TYPES", "layer_types", "rotary_by_layer_type", "sliding_window"]

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)


def layer_types(config: PretrainedConfig, default_pattern: int) -> list[str]:
    """``config.layer_types``, else every ``pattern``-th layer global (``pattern`` from
    ``sliding_window_pattern`` or ``default_pattern``: 2 for Gemma 2, 6 for Gemma 3)."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = int(getattr(config, "sliding_window_pattern", None) or default_pattern)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    types = list(types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n:
        raise ValueError(f"layer_types must list {n} entries out of {', '.join(LAYER_TYPES)}; "
                         f"got {len(types)} entries" + (f", unknown {unknown}" if unknown else ""))
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (sgl serves causal "
                         "decoders); supported: false")
    return types


def sliding_window(config: PretrainedConfig, layer_type: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    return int(window) if layer_type == SLIDING and window else None


def rotary_by_layer_type(config: PretrainedConfig, head_dim: int, types: list[str], *,
                         per_type: bool,
                         device: torch.device) -> dict[str, RotaryEmbedding]:
    """One rotary embedding per layer type in use. ``per_type`` (Gemma 3): local layers have
    their own settings (``rope_local_base_freq``, no scaling); else all layers share one."""
    params = getattr(config, "rope_parameters", None)
    has_per_type = isinstance(params, dict) and FULL in params
    shared = get_rope(config, head_dim, device=device)
    out: dict[str, RotaryEmbedding] = {}
    for kind in dict.fromkeys(types):
        if kind == FULL or not per_type:
            out[kind] = shared
        elif has_per_type and params.get(SLIDING):
            out[kind] = get_rope(config, head_dim, device=device, layer_type=SLIDING)
        else:  # pre-transformers-5 Gemma 3 config
            local = {"rope_type": "default",
                     "rope_theta": float(getattr(config, "rope_local_base_freq", None) or 10000.0)}
            full = rope_parameters(config)
            rotary_dim = int(head_dim * float(full.get("partial_rotary_factor") or 1.0))
            out[kind] = RotaryEmbedding(head_dim, rotary_dim,
                                        int(config.max_position_embeddings), local, device=device)
    return out
