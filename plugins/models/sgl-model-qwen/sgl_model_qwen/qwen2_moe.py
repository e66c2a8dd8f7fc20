"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention with mixture-of-experts MLPs.

A sparse layer routes each token to ``num_experts_per_tok`` of ``num_experts`` experts
(softmax top-k, renormalised when ``norm_topk_prob``) and adds a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1)`` is not a multiple of ``decoder_sparse_step``; other layers have a dense MLP of
``intermediate_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_model_llama.decoder import DecoderOptions, SparseMoeBlock
from sgl_model_qwen.qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

__all__ = ["Qwen2MoeForCausalLM", "is_sparse_layer"]


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """transformers' rule for which Qwen2-MoE layers hold experts."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_id not in mlp_only and int(getattr(config, "num_experts", 0) or 0) > 0
            and (layer_id + 1) % step == 0)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """``Qwen2MoeForCausalLM`` checkpoints."""

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)),
                              activation=getattr(config, "hidden_act", "silu"))

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_id: int, options: DecoderOptions, *,
                  dtype: torch.dtype, device: torch.device) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return super().build_mlp(config, layer_id, options, dtype=dtype, device=device)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        return SparseMoeBlock(config, options, shared_intermediate_size=shared, dtype=dtype,
                              device=device)

    @classmethod
    def default_sliding(cls, config: PretrainedConfig, layer_id: int) -> bool:
        """transformers' Qwen2-MoE rule: even-indexed layers below ``max_window_layers``."""
        return layer_id % 2 == 0 and layer_id < int(getattr(config, "max_window_layers", 0) or 0)
