"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): the Llama decoder with Phi's checkpoint layout.

Same maths as ``transformers``' ``Phi3ForCausalLM``. Its checkpoints store q/k/v as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` tensor, split here into the shards of sgl's
tensor-parallel layers. What the decoder takes from the config as it does for any family:

* partial rotary embedding (``partial_rotary_factor``, e.g. 0.75 in Phi-4-mini): only the first
  features of each head are rotated;
* ``longrope`` scaling (short factors up to ``original_max_position_embeddings``, long factors
  beyond; see :mod:`sgl.layers.longrope`).

An optional ``sliding_window`` applies to every layer (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from sgl.models.loading import MappedWeight
from sgl_model_llama.decoder import DecoderForCausalLM, head_dim_of

if TYPE_CHECKING:
    import torch

__all__ = ["Phi3ForCausalLM"]


class Phi3ForCausalLM(DecoderForCausalLM):
    """``Phi3ForCausalLM`` checkpoints (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini)."""

    window_on_every_layer = True

    def map_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[MappedWeight]:
        """Split the checkpoint's fused tensors into the shards the layers load one by one."""
        config = self.config
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = head_dim_of(config)
        qkv_sizes = [config.num_attention_heads * head_dim, kv * head_dim, kv * head_dim]
        for item in super().map_weights(weights):
            name, tensor = item.source, item.tensor
            module = name.split(".")[-2] if "." in name else ""
            if module == "qkv_proj" and tensor.shape[0] == sum(qkv_sizes):
                for shard, part in zip("qkv", tensor.split(qkv_sizes, dim=0)):
                    yield MappedWeight(name, name, shard, part)
            elif module == "qkv_proj":  # the layer's loader reports the mismatch
                yield MappedWeight(name, name, "q", tensor)
            elif module == "gate_up_proj":
                for shard, part in enumerate(tensor.chunk(2, dim=0)):
                    yield MappedWeight(name, name, shard, part)
            else:
                yield item
