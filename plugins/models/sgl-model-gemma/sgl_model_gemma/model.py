"""The Gemma 2 and Gemma 3 (text) decoders on sgl's ragged batches and paged KV pool.

Same maths as ``transformers``' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``:

* embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype first);
* RMSNorm scaling by ``1 + weight``, four per layer: before and after attention, before and after
  the MLP (the post-norms apply to the sub-block's output, before the residual add);
* a gated MLP with ``hidden_activation`` (``gelu_pytorch_tanh``);
* attention scaled by ``query_pre_attn_scalar ** -0.5``, local (sliding-window) and global layers
  interleaved as ``layer_types`` says;
* Gemma 2: tanh soft-capping of attention scores (``attn_logit_softcapping``) and of the final
  logits (``final_logit_softcapping``);
* Gemma 3: RMSNorm of each query and key head (QK norm) before the rotary embedding, a separate
  rotary base for local layers; final soft-capping if the config sets it. Like transformers,
  Gemma 3 ignores ``attn_logit_softcapping``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

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
)
from sgl.models.base import BaseCausalLM
from sgl.models.loading import MappedWeight, load_mapped_weights
from sgl_model_gemma.layout import layer_types, rotary_by_layer_type, sliding_window

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.engine.forward_batch import ForwardBatch

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]

# Hugging Face projection -> (fused parameter, shard id)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_SHARDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _norm(config: PretrainedConfig, size: int, *, dtype: torch.dtype,
          device: torch.device) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype=dtype, device=device, weight_offset=1.0)


class GemmaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, layer_type: str,
                 rotary: RotaryEmbedding, *, qk_norm: bool, attn_softcap: float | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=bias,
                                        dtype=dtype, device=device)
        if qk_norm:
            self.q_norm: RMSNorm | None = _norm(config, head_dim, dtype=dtype, device=device)
            self.k_norm: RMSNorm | None = _norm(config, head_dim, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=head_dim,
                              scaling=float(config.query_pre_attn_scalar) ** -0.5,
                              sliding_window=sliding_window(config, layer_type),
                              logit_softcap=attn_softcap)

    def _per_head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, self.head_dim)
        return norm(heads)[0].view(x.shape[0], -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._per_head_norm(self.q_norm, q), self._per_head_norm(self.k_norm, k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, dtype=dtype, device=device)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self.act = GatedActivation(act or "gelu_pytorch_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, layer_type: str,
                 rotary: RotaryEmbedding, *, qk_norm: bool, attn_softcap: float | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size = config.hidden_size
        self.input_layernorm = _norm(config, size, dtype=dtype, device=device)
        self.self_attn = GemmaAttention(config, layer_id, layer_type, rotary, qk_norm=qk_norm,
                                        attn_softcap=attn_softcap, dtype=dtype, device=device)
        self.post_attention_layernorm = _norm(config, size, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = _norm(config, size, dtype=dtype, device=device)
        self.mlp = GemmaMLP(config, dtype=dtype, device=device)
        self.post_feedforward_layernorm = _norm(config, size, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` is the previous layer's (post-normed) MLP output, not yet added to
        ``residual``; returns the same pair for the next layer."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden, _ = self.post_attention_layernorm(self.self_attn(positions, hidden, batch))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, *, qk_norm: bool, attn_softcap: float | None,
                 rope_per_layer_type: bool, default_pattern: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   dtype=dtype, device=device,
                                                   scale=config.hidden_size ** 0.5)
        types = layer_types(config, default_pattern)
        rotary = rotary_by_layer_type(config, _head_dim(config), types,
                                      per_type=rope_per_layer_type, device=device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, kind, rotary[kind], qk_norm=qk_norm,
                              attn_softcap=attn_softcap, dtype=dtype, device=device)
            for i, kind in enumerate(types)
        )
        self.norm = _norm(config, config.hidden_size, dtype=dtype, device=device)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(batch.positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class _GemmaForCausalLM(BaseCausalLM):
    #: Gemma 3: per-head RMSNorm of queries and keys
    qk_norm: ClassVar[bool] = False
    #: Gemma 2: soft-cap attention scores with ``attn_logit_softcapping``
    attn_softcap: ClassVar[bool] = False
    #: Gemma 3: local layers have their own rotary settings
    rope_per_layer_type: ClassVar[bool] = False
    #: without ``layer_types``/``sliding_window_pattern``: every n-th layer is global
    default_pattern: ClassVar[int] = 2

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        softcap = getattr(config, "attn_logit_softcapping", None) if self.attn_softcap else None
        self.model = GemmaModel(config, qk_norm=self.qk_norm, attn_softcap=softcap or None,
                                rope_per_layer_type=self.rope_per_layer_type,
                                default_pattern=self.default_pattern, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                                      device=device,
                                      logit_softcap=getattr(config, "final_logit_softcapping",
                                                            None))
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _mapped(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[MappedWeight]:
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.tied and name.startswith("lm_head.")):
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                yield name, ".".join([*parts[:-2], fused, parts[-1]]), shard, tensor
            else:
                yield name, name, None, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, self._mapped(weights), fused_shards=_FUSED_SHARDS)


class Gemma2ForCausalLM(_GemmaForCausalLM):
    """``Gemma2ForCausalLM`` checkpoints (Gemma 2 2B/9B/27B)."""

    attn_softcap = True
    default_pattern = 2


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """``Gemma3ForCausalLM`` checkpoints: the text model of Gemma 3 (``Gemma3TextConfig``,
    e.g. gemma-3-1b)."""

    qk_norm = True
    rope_per_layer_type = True
    default_pattern = 6
