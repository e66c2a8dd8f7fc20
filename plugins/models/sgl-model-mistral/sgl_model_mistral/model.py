"""The Mistral decoder on sgl's ragged batches and paged KV pool.

Same maths as ``transformers``' ``MistralForCausalLM``: a Llama-style decoder (RMSNorm, rotary
attention with grouped-query heads, SiLU-gated MLP) whose attention may be limited to a sliding
window of ``config.sliding_window`` tokens (None: full attention), on every layer. ``head_dim``
may differ from ``hidden_size / num_attention_heads`` (Mistral NeMo).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
from sgl.models.loading import MappedWeight, load_mapped_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.engine.forward_batch import ForwardBatch

__all__ = ["MistralForCausalLM"]

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


def _sliding_window(config: PretrainedConfig) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens or null, "
                         f"got {window}")
    return None if window is None else int(window)


class MistralAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, dtype=dtype,
                                        device=device)
        self.rotary = rotary
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=head_dim,
                              sliding_window=_sliding_window(config))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class MistralMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, dtype=dtype, device=device)
        self.act = GatedActivation(getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class MistralDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.self_attn = MistralAttention(config, layer_id, rotary, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.mlp = MistralMLP(config, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MistralModel(nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   dtype=dtype, device=device)
        rotary = get_rope(config, _head_dim(config), device=device)
        self.layers = nn.ModuleList(
            MistralDecoderLayer(config, i, rotary, dtype=dtype, device=device)
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


class MistralForCausalLM(BaseCausalLM):
    """``MistralForCausalLM`` checkpoints (Mistral 7B v0.1-v0.3, Mistral NeMo, ...)."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        self.model = MistralModel(config, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                                      device=device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
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
