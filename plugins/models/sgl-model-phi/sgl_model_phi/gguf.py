"""The Phi-3 GGUF architecture. llama.cpp's converter fuses q/k/v (``attn_qkv``) and gate/up
(``ffn_up``); the config gets partial rotary (``rope.dimension_count`` of ``head_dim``), the
sliding window (0: none) and LongRoPE from the ``rope_factors_long``/``short`` tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.model_loader.gguf_archs import DECODER_LAYER_NAMES, GGUFArch
from sgl.model_loader.gguf_config import head_dim_of, update_rope

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.model_loader.gguf_config import GGUFMetadata

__all__ = ["PHI3"]


def _complete(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    params: dict[str, Any] = {}
    rope_dims = meta.arch_get("rope.dimension_count")
    if rope_dims and int(rope_dims) != head_dim_of(config):
        params["partial_rotary_factor"] = int(rope_dims) / head_dim_of(config)
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
        update_rope(config, params)


PHI3 = GGUFArch("phi3", {k: v for k, v in DECODER_LAYER_NAMES.items() if k != "ffn_up"},
                fused={"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       "ffn_up": ("mlp.gate_proj", "mlp.up_proj")},
                complete_config=_complete)
