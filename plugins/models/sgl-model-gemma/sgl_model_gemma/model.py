"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's norms, scales and layer kinds.

Same maths as ``transformers``' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``:

* embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype first);
* RMSNorm scaling by ``1 + weight``, four per layer: before and after attention, before and after
  the MLP (the post-norms apply to the sub-block's output, before the residual add);
* a gated MLP with ``hidden_activation`` (``gelu_pytorch_tanh``);
* attention scaled by ``query_pre_attn_scalar ** -0.5``, local (sliding-window) and global layers
  interleaved as ``layer_types`` says (see :mod:`sgl_model_gemma.layout`);
* Gemma 2: tanh soft-capping of attention scores (``attn_logit_softcapping``) and of the final
  logits (``final_logit_softcapping``);
* Gemma 3: RMSNorm of each query and key head (QK norm) before the rotary embedding, a separate
  rotary base for local layers; final soft-capping if the config sets it. Like transformers,
  Gemma 3 ignores ``attn_logit_softcapping``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from sgl_model_gemma.layout import layer_types, rotary_by_layer_type, sliding_window
from sgl_model_llama.decoder import DecoderForCausalLM, DecoderOptions

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from sgl.layers import RotaryEmbedding

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


class _GemmaForCausalLM(DecoderForCausalLM):
    #: Gemma 3: per-head RMSNorm of queries and keys, no attention soft-capping
    gemma3: ClassVar[bool] = False
    #: without ``layer_types``/``sliding_window_pattern``: every n-th layer is global
    default_pattern: ClassVar[int] = 2

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        activation = (getattr(config, "hidden_activation", None)
                      or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh")
        softcap = None if cls.gemma3 else getattr(config, "attn_logit_softcapping", None)
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=cls.gemma3, norm_offset=1.0,
                              sandwich_norms=True, embed_scale=config.hidden_size ** 0.5,
                              attn_scaling=float(config.query_pre_attn_scalar) ** -0.5,
                              attn_softcap=softcap or None,
                              final_softcap=getattr(config, "final_logit_softcapping", None),
                              activation=activation, tie_word_embeddings=True)

    @classmethod
    def sliding_window(cls, config: PretrainedConfig, layer_id: int) -> int | None:
        return sliding_window(config, layer_types(config, cls.default_pattern)[layer_id])

    @classmethod
    def rotary_embeddings(cls, config: PretrainedConfig, head_dim: int, *,
                          device: torch.device) -> list[RotaryEmbedding]:
        types = layer_types(config, cls.default_pattern)
        rotary = rotary_by_layer_type(config, head_dim, types, per_type=cls.gemma3,
                                      device=device)
        return [rotary[kind] for kind in types]


class Gemma2ForCausalLM(_GemmaForCausalLM):
    """``Gemma2ForCausalLM`` checkpoints (Gemma 2 2B/9B/27B)."""


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """``Gemma3ForCausalLM`` checkpoints: the text model of Gemma 3 (``Gemma3TextConfig``,
    e.g. gemma-3-1b)."""

    gemma3 = True
    default_pattern = 6
