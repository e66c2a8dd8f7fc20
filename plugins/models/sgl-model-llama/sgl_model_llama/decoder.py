"""One Llama-style decoder on sgl's ragged batches and paged KV pool, for every family built on it.

Llama, Mistral, Phi-3, Qwen2/3, Qwen2-MoE and Gemma 2/3 are the same network: token embedding,
then per layer an RMSNorm, rotary attention with grouped-query heads, an RMSNorm and a gated MLP
(or a mixture of experts), each with a residual add; a final norm and the LM head. What a family
changes is data, :class:`DecoderOptions`, plus three per-layer choices a subclass of
:class:`DecoderForCausalLM` may override: which layers use a sliding window
(:meth:`~DecoderForCausalLM.sliding_window`), the rotary embedding of each layer
(:meth:`~DecoderForCausalLM.rotary_embeddings`) and the MLP of each layer
(:meth:`~DecoderForCausalLM.build_mlp`). Checkpoint names are mapped by
:meth:`~DecoderForCausalLM.map_weights` and loaded by :func:`sgl.models.load_mapped_weights`.

q/k/v and gate/up projections are fused into one matmul each, and the residual add is fused
into the next norm. Parameter names are those of the Hugging Face checkpoints (with the fused
projections), so a family plugin's checkpoint loads without renaming.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from sgl.layers import (
    Attention,
    FusedMoE,
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
from sgl.models.loading import MappedWeight, load_mapped_weights, map_fused_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.forward_batch import ForwardBatch

__all__ = ["DecoderForCausalLM", "DecoderOptions", "GatedMLP", "SparseMoeBlock", "head_dim_of"]

# checkpoint entries that are not parameters here
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class DecoderOptions:
    """What a family changes in the decoder; the defaults are Llama's."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    #: RMSNorm of each query and key head before the rotary embedding (Qwen3, Gemma 3)
    qk_norm: bool = False
    #: every RMSNorm scales by ``norm_offset + weight`` (Gemma: 1.0)
    norm_offset: float = 0.0
    #: norms on the outputs of attention and MLP too, before their residual adds (Gemma 2/3)
    sandwich_norms: bool = False
    #: the embeddings are multiplied by this (Gemma: ``sqrt(hidden_size)``)
    embed_scale: float | None = None
    #: attention scale (None: ``head_dim ** -0.5``)
    attn_scaling: float | None = None
    #: tanh soft-capping of attention scores and of the final logits (Gemma 2)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    activation: str = "silu"
    tie_word_embeddings: bool = False


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; also a MoE layer's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, *,
                 bias: bool = False, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], bias=bias,
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(size, hidden_size, bias=bias, dtype=dtype,
                                           device=device)
        self.act = GatedActivation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _replicated(in_features: int, out_features: int, *, dtype: torch.dtype,
                device: torch.device) -> nn.Linear:
    """A small bias-free projection every tensor-parallel rank holds whole."""
    linear = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    linear.requires_grad_(False)
    return linear


class SparseMoeBlock(nn.Module):
    """A router (``gate``), routed ``experts`` (softmax top-k) and an optional
    ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, config: PretrainedConfig, options: DecoderOptions, *,
                 shared_intermediate_size: int = 0, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = _replicated(hidden, config.num_experts, dtype=dtype, device=device)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, hidden,
                                config.moe_intermediate_size,
                                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                                activation=options.activation, dtype=dtype, device=device)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden, shared_intermediate_size, options.activation,
                                          dtype=dtype, device=device)
            self.shared_expert_gate = _replicated(hidden, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _norm(config: PretrainedConfig, size: int, options: DecoderOptions, *, dtype: torch.dtype,
          device: torch.device) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype=dtype, device=device,
                   weight_offset=options.norm_offset)


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary: RotaryEmbedding,
                 options: DecoderOptions, sliding_window: int | None, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=options.qkv_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size,
                                        bias=options.o_bias, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            self.q_norm = _norm(config, head_dim, options, dtype=dtype, device=device)
            self.k_norm = _norm(config, head_dim, options, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=head_dim,
                              scaling=options.attn_scaling, sliding_window=sliding_window,
                              logit_softcap=options.attn_softcap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm.per_head(q, self.head_dim)
            k = self.k_norm.per_head(k, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attn: DecoderAttention, mlp: nn.Module,
                 options: DecoderOptions, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size = config.hidden_size
        self.sandwich = options.sandwich_norms
        self.input_layernorm = _norm(config, size, options, dtype=dtype, device=device)
        self.self_attn = attn
        # Hugging Face's names: with sandwich norms, post_attention_layernorm is the norm of
        # the attention's output and pre_feedforward_layernorm the norm before the MLP
        self.post_attention_layernorm = _norm(config, size, options, dtype=dtype, device=device)
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config, size, options, dtype=dtype,
                                                   device=device)
            self.post_feedforward_layernorm = _norm(config, size, options, dtype=dtype,
                                                    device=device)
        self.mlp = mlp
        #: keep the residual stream entering this layer in :attr:`stream` (EAGLE-3)
        self.keep_stream = False
        self.stream: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` is the previous layer's output, not yet added to ``residual``; returns
        the same pair for the next layer."""
        hidden, residual = self.input_layernorm(hidden, residual)
        if self.keep_stream:  # the norm's sum, a tensor of its own: kept, not copied
            self.stream = residual
        hidden = self.self_attn(positions, hidden, batch)
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm; ``arch`` supplies the per-family choices."""

    def __init__(self, config: PretrainedConfig, arch: type[DecoderForCausalLM],
                 options: DecoderOptions, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   dtype=dtype, device=device,
                                                   scale=options.embed_scale)
        rotary = arch.rotary_embeddings(config, head_dim_of(config), device=device)
        long = {isinstance(r, LongRopeRotaryEmbedding) for r in rotary}
        if len(long) > 1:
            raise ValueError("longrope must be the rotary embedding of every layer or of none")
        #: longrope: the layers read the cache rows of the short or the long factors
        self.long_rope = rotary[0] if long == {True} else None
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                DecoderAttention(config, i, rotary[i], options, arch.sliding_window(config, i),
                                 dtype=dtype, device=device),
                arch.build_mlp(config, i, options, dtype=dtype, device=device),
                options, dtype=dtype, device=device,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size, options, dtype=dtype, device=device)
        #: indices of the layers whose incoming hidden states each forward keeps (EAGLE-3;
        #: ``len(layers)``: the last layer's output), in :attr:`captured`
        self.capture: tuple[int, ...] = ()
        self.captured: list[torch.Tensor] | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        positions = batch.positions
        if self.long_rope is not None:
            positions = self.long_rope.cache_positions(positions, batch.seq_lens,
                                                       batch.extend_seq_lens)
        hidden = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, stream = self.norm(hidden, residual)
        if self.capture:
            self.captured = [stream if i == len(self.layers) else self.layers[i].stream
                             for i in self.capture]
        return hidden


class DecoderForCausalLM(BaseCausalLM):
    """The decoder as a causal LM. A family is a subclass that overrides :meth:`options` and,
    where it differs from Llama, the per-layer choices and :meth:`map_weights`."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(config, dtype=dtype, device=device)
        options = self.options(config)
        self.model = DecoderModel(config, type(self), options, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                                      device=device, logit_softcap=options.final_softcap)
        self.tied = bool(getattr(config, "tie_word_embeddings", options.tie_word_embeddings))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    # -- what a family changes -----------------------------------------------------------------

    @classmethod
    def options(cls, config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias,
                              mlp_bias=bool(getattr(config, "mlp_bias", False)),
                              activation=getattr(config, "hidden_act", "silu"))

    #: every layer attends to the last ``config.sliding_window`` tokens (Mistral, Phi-3)
    window_on_every_layer: ClassVar[bool] = False

    @classmethod
    def sliding_window(cls, config: PretrainedConfig, layer_id: int) -> int | None:
        """Layer ``layer_id``'s attention window in tokens; None: full attention. By default
        none, or with :attr:`window_on_every_layer` ``config.sliding_window`` (null: none)."""
        if not cls.window_on_every_layer:
            return None
        window = getattr(config, "sliding_window", None)
        if window is not None and int(window) < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or null, "
                             f"got {window}")
        return None if window is None else int(window)

    @classmethod
    def rotary_embeddings(cls, config: PretrainedConfig, head_dim: int, *,
                          device: torch.device) -> list[RotaryEmbedding]:
        """The rotary embedding of each layer (by default one, shared by all)."""
        return [get_rope(config, head_dim, device=device)] * config.num_hidden_layers

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_id: int, options: DecoderOptions, *,
                  dtype: torch.dtype, device: torch.device) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, options.activation,
                        bias=options.mlp_bias, dtype=dtype, device=device)

    def map_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[MappedWeight]:
        """Checkpoint tensors under the parameters that take them (see :func:`sgl.models.loading.map_fused_name`);
        a tied ``lm_head`` and the rotary tables some checkpoints carry are dropped."""
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.tied and name.startswith("lm_head.")):
                continue
            yield map_fused_name(name, tensor)

    # -- BaseCausalLM --------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch)
        self.captured_parts = self.model.captured
        return hidden

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def capture_hidden_layers(self, layer_ids: Sequence[int]) -> None:
        layers = len(self.model.layers)
        wrong = [i for i in layer_ids if not 0 <= i <= layers]
        if wrong or len(set(layer_ids)) != len(layer_ids) or list(layer_ids) != sorted(layer_ids):
            raise ValueError(f"layers to capture must be distinct and ascending, from 0 to "
                             f"{layers} (the last layer's output), got {list(layer_ids)}")
        self.model.capture = tuple(layer_ids)
        for i, layer in enumerate(self.model.layers):
            layer.keep_stream = i in self.model.capture

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, self.map_weights(weights))
