"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention with mixture-of-experts MLPs.

A sparse layer routes each token to ``num_experts_per_tok`` of ``num_experts`` experts
(softmax top-k, renormalised when ``norm_topk_prob``) and adds a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1)`` is not a multiple of ``decoder_sparse_step``; other layers have a dense MLP of
``intermediate_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from sgl.layers import FusedMoE
from sgl_model_qwen.qwen2 import AttentionOptions, Qwen2ForCausalLM, QwenMLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Qwen2MoeForCausalLM", "Qwen2MoeSparseBlock", "is_sparse_layer"]


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """transformers' rule for which Qwen2-MoE layers hold experts."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_id not in mlp_only and int(getattr(config, "num_experts", 0) or 0) > 0
            and (layer_id + 1) % step == 0)


def _replicated(in_features: int, out_features: int, *, dtype: torch.dtype,
                device: torch.device) -> nn.Linear:
    """A small bias-free projection every tensor-parallel rank holds whole."""
    linear = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    linear.requires_grad_(False)
    return linear


class Qwen2MoeSparseBlock(nn.Module):
    """Router (``gate``), routed ``experts`` and the gated ``shared_expert``."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = _replicated(hidden, config.num_experts, dtype=dtype, device=device)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, hidden,
                                config.moe_intermediate_size,
                                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                                activation=getattr(config, "hidden_act", "silu"),
                                dtype=dtype, device=device)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert: QwenMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared > 0:
            self.shared_expert = QwenMLP(config, shared, dtype=dtype, device=device)
            self.shared_expert_gate = _replicated(hidden, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """``Qwen2MoeForCausalLM`` checkpoints."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_id: int, *, dtype: torch.dtype,
                  device: torch.device) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return Qwen2MoeSparseBlock(config, dtype=dtype, device=device)
        return QwenMLP(config, config.intermediate_size, dtype=dtype, device=device)

    @classmethod
    def default_sliding(cls, config: PretrainedConfig, layer_id: int) -> bool:
        """transformers' Qwen2-MoE rule: even-indexed layers below ``max_window_layers``."""
        return layer_id % 2 == 0 and layer_id < int(getattr(config, "max_window_layers", 0) or 0)
