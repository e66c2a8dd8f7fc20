"""Qwen2: the Llama decoder with biased q/k/v and optional per-layer sliding windows.

Same maths as ``transformers``' ``Qwen2ForCausalLM``. Qwen3 (:mod:`sgl_model_qwen.qwen3`) and
Qwen2-MoE (:mod:`sgl_model_qwen.qwen2_moe`) change the options and which layers slide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_model_llama.decoder import DecoderForCausalLM, DecoderOptions

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(DecoderForCausalLM):
    """``Qwen2ForCausalLM`` checkpoints (Qwen2, Qwen2.5, Qwen2.5-Coder, ...)."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, activation=getattr(config, "hidden_act", "silu"))

    @classmethod
    def default_sliding(cls, config: PretrainedConfig, layer_id: int) -> bool:
        """Whether layer ``layer_id`` slides when the config lists no ``layer_types``
        (transformers' Qwen2/Qwen3 rule: layers from ``max_window_layers`` on)."""
        return layer_id >= int(getattr(config, "max_window_layers", 0) or 0)

    @classmethod
    def sliding_window(cls, config: PretrainedConfig, layer_id: int) -> int | None:
        """Layer ``layer_id``'s attention window, as transformers decides it: only with
        ``use_sliding_window`` and a positive ``sliding_window``, and only on the layers
        ``layer_types`` marks ``"sliding_attention"`` (else :meth:`default_sliding`)."""
        window = getattr(config, "sliding_window", None)
        if not getattr(config, "use_sliding_window", False) or not window:
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            sliding = layer_types[layer_id] == "sliding_attention"
        else:
            sliding = cls.default_sliding(config, layer_id)
        return int(window) if sliding else None
