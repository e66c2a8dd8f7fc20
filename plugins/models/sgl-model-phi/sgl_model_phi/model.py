"""The Phi-3 decoder (Phi-3, Phi-3.5-mini, Phi-4-mini) on sgl's ragged batches and paged KV pool.

Same maths as ``transformers``' ``Phi3ForCausalLM``: a Llama-style decoder whose checkpoints
store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` tensor (split here into the
shards of sgl's tensor-parallel layers), with

* partial rotary embedding (``partial_rotary_factor``, e.g. 0.75 in Phi-4-mini): only the first
  features of each head are rotated;
* ``longrope`` scaling when the config has it (short factors up to
  ``original_max_position_embeddings``, long factors beyond; see :mod:`sgl.layers.longrope`);
* an optional ``sliding_window`` on every layer (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from sgl.layers import (
    Attention,
    GatedActivation,
    LongRopeRotaryEmbedding,
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

__all__ = ["Phi3ForCausalLM"]

_FUSED_SHARDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _num_kv_heads(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class Phi3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        num_heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads,
                                          _num_kv_heads(config), dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, dtype=dtype,
                                        device=device)
        self.rotary = rotary
        window = getattr(config, "sliding_window", None)
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=head_dim,
                              sliding_window=int(window) if window else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class Phi3MLP(nn.Module):
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


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.self_attn = Phi3Attention(config, layer_id, rotary, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.mlp = Phi3MLP(config, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Phi3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   dtype=dtype, device=device)
        self.rotary = get_rope(config, _head_dim(config), device=device)
        self.layers = nn.ModuleList(
            Phi3DecoderLayer(config, i, self.rotary, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        positions = batch.positions
        if isinstance(self.rotary, LongRopeRotaryEmbedding):
            positions = self.rotary.cache_positions(positions, batch.seq_lens,
                                                    batch.extend_seq_lens)
        hidden = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Phi3ForCausalLM(BaseCausalLM):
    """``Phi3ForCausalLM`` checkpoints (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini)."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        self.model = Phi3Model(config, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                                      device=device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)
        head_dim = _head_dim(config)
        self._qkv_sizes = [config.num_attention_heads * head_dim,
                           _num_kv_heads(config) * head_dim, _num_kv_heads(config) * head_dim]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _mapped(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[MappedWeight]:
        """Split the checkpoint's fused tensors into the shards the layers load one by one."""
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.tied and name.startswith("lm_head.")):
                continue
            module = name.split(".")[-2] if "." in name else ""
            if module == "qkv_proj":
                if tensor.shape[0] != sum(self._qkv_sizes):
                    yield name, name, "q", tensor  # the layer's loader reports the mismatch
                    continue
                for shard, part in zip("qkv", tensor.split(self._qkv_sizes, dim=0)):
                    yield name, name, shard, part
            elif module == "gate_up_proj":
                for shard, part in enumerate(tensor.chunk(2, dim=0)):
                    yield name, name, shard, part
            else:
                yield name, name, None, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, self._mapped(weights), fused_shards=_FUSED_SHARDS)
