"""EAGLE draft heads in their published Hugging Face layout, on sgl's layers and paged KV.

An EAGLE head is a small decoder that reads, at position ``p``, the next token ``x[p + 1]``
and the target's hidden state ``f[p]`` (what the target's LM head turned into ``x[p + 1]``),
and outputs a state from which the token after that is read; that state is its input at the
next position when it drafts on by itself.

- **EAGLE / EAGLE-2** (:class:`EagleHead`, Li et al. 2024): ``fc(cat(embed(x), f))`` with a
  bias, then Llama decoder layers (the first without its input norm), no final norm; the
  state is the stream after the last layer, and the target's LM head reads it. ``f`` is the
  target's last hidden state after its final norm. Checkpoint names: ``fc.*``,
  ``layers.N.*``; the embedding and LM head are the target's (SGLang's sharing).
- **EAGLE-3** (:class:`Eagle3Head`): ``f`` is three of the target's layer states
  concatenated (``fc`` maps ``3 * target_hidden`` to ``hidden``; the head's own states come
  back without it). One layer whose attention reads ``cat(input_norm(embed(x)),
  hidden_norm(h))``, ``2 * hidden`` wide; a final norm; its own LM head over a reduced draft
  vocabulary, whose ids ``d2t`` maps to the target's (``target = draft + d2t[draft]``).
  Checkpoint names: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
  ``d2t``, ``t2d``; the embedding is the target's when the widths agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from sgl.layers import (
    Attention,
    ColumnParallelLinear,
    GatedActivation,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from sgl.model_loader import ModelLoadError
from sgl.models.loading import MappedWeight, load_mapped_weights, map_fused_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.forward_batch import ForwardBatch

__all__ = ["Eagle3Head", "EagleHead", "aux_layer_ids", "head_design"]


def head_design(config: PretrainedConfig) -> int | None:
    """3 for an EAGLE-3 head's config, 1 for an EAGLE one's, None when it does not say (EAGLE
    heads are often published as plain ``LlamaForCausalLM``)."""
    archs = " ".join(getattr(config, "architectures", None) or []).lower()
    if "eagle3" in archs or getattr(config, "draft_vocab_size", None) is not None:
        return 3
    return 1 if "eagle" in archs else None


def aux_layer_ids(config: PretrainedConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming states EAGLE-3 reads (``BaseCausalLM`` indices, the
    number of layers naming the last one's output): the draft config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or under ``eagle_config``; id ``j`` is the
    output of layer ``j``), else SGLang's ``2, N // 2, N - 3``."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or (
        eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None)
    if ids:
        return tuple(int(i) + 1 for i in ids)
    layers = (2, target_layers // 2, target_layers - 3)
    if not 0 < layers[0] < layers[1] < layers[2]:
        raise ModelLoadError(
            f"EAGLE-3's default layers {list(layers)} do not fit a target of {target_layers} "
            "layers; give eagle_aux_hidden_state_layer_ids in the draft model's config.json")
    return layers


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _checked(weights: Iterable[tuple[str, torch.Tensor]],
             version: int) -> list[tuple[str, torch.Tensor]]:
    """The head's tensors (names without a ``model.`` prefix), refused with the algorithm to
    use when their names are the other design's (a config need not say which it is)."""
    named = [(_strip(name), tensor) for name, tensor in weights]
    eagle3 = any(n.startswith("midlayer.") or n in ("d2t", "t2d") for n, _ in named)
    eagle = any(n.startswith("layers.") for n, _ in named)
    if version == 1 and eagle3:
        raise ModelLoadError("its tensors (midlayer.*, d2t) are an EAGLE-3 head's; serve it "
                             "with --speculative-algorithm EAGLE3")
    if version == 3 and eagle and not eagle3:
        raise ModelLoadError("its tensors (layers.N.*) are an EAGLE (1/2) head's; serve it "
                             "with --speculative-algorithm EAGLE")
    return named


class _Attention(nn.Module):
    """Rotary grouped-query attention reading ``in_size`` features, writing ``hidden_size``."""

    def __init__(self, config: PretrainedConfig, in_size: int, layer_id: int, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(in_size, head_dim, heads, kv_heads, bias=bias,
                                          dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias,
                                        dtype=dtype, device=device)
        self.rotary = get_rope(config, head_dim, device=device)
        self.attn = Attention(layer_id=layer_id, num_heads=self.qkv_proj.num_heads,
                              num_kv_heads=self.qkv_proj.num_kv_heads, head_dim=head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class _MLP(nn.Module):
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


class _Layer(nn.Module):
    """A Llama decoder layer; EAGLE's first has no input norm."""

    def __init__(self, config: PretrainedConfig, layer_id: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = None if layer_id == 0 else RMSNorm(size, eps, dtype=dtype,
                                                                  device=device)
        self.self_attn = _Attention(config, size, layer_id, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.mlp = _MLP(config, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_layernorm is None:  # the first layer: nothing to add yet
            h, residual = x, x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, batch), residual)
        return self.mlp(h), residual


class EagleHead(nn.Module):
    """EAGLE / EAGLE-2: see the module docstring. ``forward`` returns the output state twice:
    the target's LM head reads it, and it is the input state of the next position."""

    num_layers: int

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        size = config.hidden_size
        self.fc = ColumnParallelLinear(2 * size, size, bias=bool(getattr(config, "bias", True)),
                                       dtype=dtype, device=device)
        self.layers = nn.ModuleList(_Layer(config, i, dtype=dtype, device=device)
                                    for i in range(config.num_hidden_layers))
        self.num_layers = config.num_hidden_layers

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor, states: torch.Tensor,
                from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([embeds, states], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(batch.positions, x, residual, batch)
        out = x + residual
        return out, out

    def map_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[MappedWeight]:
        for name, tensor in _checked(weights, 1):
            # the target's embedding and LM head are used; EAGLE's first layer has no input norm
            if name in ("embed_tokens.weight", "lm_head.weight",
                        "layers.0.input_layernorm.weight") or name.endswith("rotary_emb.inv_freq"):
                continue
            yield map_fused_name(name, tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, self.map_weights(weights))


class _Eagle3Layer(nn.Module):
    """EAGLE-3's layer: attention over ``cat(input_norm(embeds), hidden_norm(h))``."""

    def __init__(self, config: PretrainedConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.self_attn = _Attention(config, 2 * size, 0, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype=dtype, device=device)
        self.mlp = _MLP(config, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, h: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds)[0], self.hidden_norm(h)[0]], dim=-1)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x, batch), h)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """EAGLE-3: see the module docstring. ``forward`` returns the normed state (for
    :meth:`logits`) and the state before the norm (the next position's input).

    :param target_hidden: the width of each of the target's three states.
    :param own_embedding: the head embeds tokens itself (its width differs from the target's).

    Without ``draft_vocab_size`` in its config the head has no LM head of its own and the
    target's reads its normed state (SGLang's ``load_lm_head_from_target``): :attr:`lm_head`
    is None.
    """

    num_layers = 1

    def __init__(self, config: PretrainedConfig, *, target_hidden: int, own_embedding: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ModelLoadError(f"EAGLE-3 heads have one decoder layer; this config has "
                                 f"{config.num_hidden_layers}")
        size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, size, dtype=dtype,
                                                   device=device) if own_embedding else None
        self.fc = ColumnParallelLinear(3 * target_hidden, size,
                                       bias=bool(getattr(config, "bias", False)),
                                       dtype=dtype, device=device)
        self.midlayer = _Eagle3Layer(config, dtype=dtype, device=device)
        self.norm = RMSNorm(size, config.rms_norm_eps, dtype=dtype, device=device)
        own_head = getattr(config, "draft_vocab_size", None) is not None
        self.draft_vocab = int(config.draft_vocab_size if own_head else config.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab, size, dtype=dtype,
                                      device=device) if own_head else None
        #: the target's id of each draft-vocabulary id (``d2t`` added to the index)
        self.hot_token_ids = torch.arange(self.draft_vocab, device=device)

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor, states: torch.Tensor,
                from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(states) if from_target else states
        x, residual = self.midlayer(batch.positions, embeds, h, batch)
        return self.norm(x, residual)


    def map_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[MappedWeight]:
        for name, tensor in _checked(weights, 3):
            if name == "d2t":
                if tensor.shape != (self.draft_vocab,):
                    raise ModelLoadError(f"d2t has shape {tuple(tensor.shape)}, expected "
                                         f"({self.draft_vocab},) (draft_vocab_size)")
                self.hot_token_ids = (tensor.to(torch.int64) + torch.arange(
                    self.draft_vocab)).to(self.hot_token_ids.device)
                continue
            if name == "t2d" or (name == "embed_tokens.weight" and self.embed_tokens is None) \
                    or (name == "lm_head.weight" and self.lm_head is None):
                continue
            yield map_fused_name(name, tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, self.map_weights(weights))
