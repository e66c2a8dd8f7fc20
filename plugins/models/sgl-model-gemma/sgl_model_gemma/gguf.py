"""The Gemma 2 and 3 GGUF architectures. llama.cpp's converter added 1 to every
``*norm.weight`` (Gemma's RMSNorm scales by 1 + w); a layer has four norms, ``ffn_norm`` the
one before the MLP. The config gets llama.cpp's attention scale (``query_pre_attn_scalar``:
``hidden / heads`` for the 27B models, else ``head_dim``), the soft-caps, and Gemma 3's local
rope base and sliding-window pattern."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.model_loader.gguf_archs import DECODER_LAYER_NAMES, GGUFArch
from sgl.model_loader.gguf_config import head_dim_of, update_rope

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.model_loader.gguf_config import GGUFMetadata

__all__ = ["GEMMA2", "GEMMA3"]

_LAYER = {**DECODER_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
          "post_attention_norm": "post_attention_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
#: the layer count of the 27B models, whose attention scale is 1/sqrt(hidden / heads)
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _complete(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                    if config.num_hidden_layers == _LAYERS_27B[meta.arch]
                                    else head_dim_of(config))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.arch_get(key)
        if value is not None:
            setattr(config, key, float(value) or None)
    if meta.arch != "gemma3":
        return
    local_theta = float(meta.arch_get("rope.freq_base_swa") or 10000.0)
    if "full_attention" in (getattr(config, "rope_parameters", None) or {}):
        update_rope(config, {"rope_type": "default", "rope_theta": local_theta},
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


GEMMA2 = GGUFArch("gemma2", _LAYER, norm_shift=1.0, complete_config=_complete)
GEMMA3 = GGUFArch("gemma3", _LAYER, norm_shift=1.0, complete_config=_complete)
