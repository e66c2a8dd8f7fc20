"""The Qwen2 decoder, and the structure Qwen3 and Qwen2-MoE build on.

Same maths as ``transformers``' ``Qwen2ForCausalLM``: a Llama-style pre-norm decoder with biased
q/k/v projections and optional per-layer sliding-window attention. Subclasses choose the
attention options (:meth:`Qwen2ForCausalLM.attention_options`), the MLP of each layer
(:meth:`Qwen2ForCausalLM.build_mlp`) and which layers slide
(:meth:`Qwen2ForCausalLM.default_sliding`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from sgl.layers import (
    Attention,
    GatedActivation,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from sgl.models.base import BaseCausalLM
from sgl_model_qwen.loading import load_qwen_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.engine.forward_batch import ForwardBatch

__all__ = ["AttentionOptions", "Qwen2ForCausalLM", "QwenAttention", "QwenDecoderLayer", "QwenMLP",
           "QwenModel", "head_dim_of"]


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the Qwen attention blocks."""

    qkv_bias: bool = True  # bias on q/k/v (Qwen2, Qwen2-MoE)
    o_bias: bool = False  # bias on the output projection
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)


class QwenAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding,
                 options: AttentionOptions, sliding_window: int | None, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads,
                                          num_kv_heads, bias=options.qkv_bias, dtype=dtype,
                                          device=device)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=options.o_bias, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=self.head_dim,
                              sliding_window=sliding_window)

    def _per_head(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's ``head_dim`` features of a flat ``[T, heads * head_dim]``
        (on CPU one kernel call on the strided view, without a copy)."""
        return norm.per_head(x, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._per_head(self.q_norm, q), self._per_head(self.k_norm, k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class QwenMLP(nn.Module):
    """The gated MLP (``down(act(gate(x)) * up(x))``), also a MoE layer's shared expert."""

    def __init__(self, config: PretrainedConfig, intermediate_size: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, dtype=dtype, device=device)
        self.act = GatedActivation(getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attn: QwenAttention, mlp: nn.Module, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype,
                                                device=device)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class QwenModel(nn.Module):
    """Embedding, decoder layers and final norm; ``arch`` supplies the per-family choices."""

    def __init__(self, config: PretrainedConfig, arch: type[Qwen2ForCausalLM], *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   dtype=dtype, device=device)
        rotary = get_rope(config, head_dim_of(config), device=device)
        options = arch.attention_options(config)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(
                config,
                QwenAttention(config, i, rotary, options, arch.sliding_window(config, i),
                              dtype=dtype, device=device),
                arch.build_mlp(config, i, dtype=dtype, device=device),
                dtype=dtype, device=device,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(batch.positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen2ForCausalLM(BaseCausalLM):
    """``Qwen2ForCausalLM`` checkpoints (Qwen2, Qwen2.5, Qwen2.5-Coder, ...)."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        self.model = QwenModel(config, type(self), dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                                      device=device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    # -- what the Qwen families change ---------------------------------------------------------

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False, qk_norm=False)

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_id: int, *, dtype: torch.dtype,
                  device: torch.device) -> nn.Module:
        return QwenMLP(config, config.intermediate_size, dtype=dtype, device=device)

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

    # -- BaseCausalLM --------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_qwen_weights(self, weights, tied=self.tied)
