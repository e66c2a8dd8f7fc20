"""Qwen3: the Qwen2 structure with per-head RMSNorm of q and k before rotary ("QK norm").

Unlike Qwen2 there is no q/k/v bias unless ``attention_bias`` asks for it (then on all four
projections, as in transformers), and ``head_dim`` is set explicitly in the config rather than
derived from ``hidden_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_model_llama.decoder import DecoderOptions
from sgl_model_qwen.qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """``Qwen3ForCausalLM`` checkpoints (Qwen3 0.6B-32B dense)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True,
                              activation=getattr(config, "hidden_act", "silu"))
