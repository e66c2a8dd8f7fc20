"""The Llama decoder on sgl's ragged batches and paged KV pool.

Same maths as ``transformers``' ``LlamaForCausalLM``; q/k/v and gate/up projections are fused
into one matmul each, and the residual add is fused into the next norm.
"""

from __future__ import annotations

from collections.abc import Iterable
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
from sgl.model_loader.errors import ModelLoadError
from sgl.models.base import BaseCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.engine.forward_batch import ForwardBatch

__all__ = ["LlamaForCausalLM"]

# Hugging Face projection -> (fused parameter, shard id)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_SHARDS = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {0, 1}}
# checkpoint entries that are not parameters here
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=bias,
                                        dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias,
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, dtype=dtype,
                                           device=device)
        self.act = GatedActivation(getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, layer_id, rotary, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype,
                                                device=device)
        self.mlp = LlamaMLP(config, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   dtype=dtype, device=device)
        rotary = get_rope(config, _head_dim(config), device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, dtype=dtype, device=device)
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


class LlamaForCausalLM(BaseCausalLM):
    """``LlamaForCausalLM`` checkpoints (Llama 2/3, SmolLM2, ...)."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        self.model = LlamaModel(config, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                                      device=device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        loaded: dict[str, set[object]] = {}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.tied and name.startswith("lm_head.")):
                continue
            target, shard = name, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}"
                )
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                if loader is not None:
                    loader(param, tensor, shard)
                elif param.shape != tensor.shape:
                    raise ModelLoadError(
                        f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
                    )
                else:
                    param.data.copy_(tensor)
            loaded.setdefault(target, set()).add(shard)
        missing = []
        for name in params:
            expected = _FUSED_SHARDS.get(name.split(".")[-2], {None})
            got = loaded.get(name, set())
            if not expected <= got:
                missing.append(name if expected == {None} else
                               f"{name} (shards {sorted(map(str, expected - got))})")
        if missing:
            raise ModelLoadError(
                f"the checkpoint left {len(missing)} parameters unfilled, e.g. "
                f"{', '.join(missing[:5])}"
            )
