"""The Qwen GGUF architectures. llama.cpp's converter writes Qwen's tensors as they are, except
that Qwen2-MoE's experts are stacked ``[E, ff, hidden]`` and its shared-expert gate is stored as
a vector; Qwen2's q/k/v biases are always there (transformers' config says so)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.model_loader.gguf_archs import DECODER_LAYER_NAMES, GGUFArch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.model_loader.gguf_config import GGUFMetadata

__all__ = ["QWEN2", "QWEN2MOE", "QWEN3"]

_MOE_LAYER = {**DECODER_LAYER_NAMES, "ffn_gate_inp": "mlp.gate",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def _complete_moe(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    """The routed and shared experts' sizes."""
    routed = meta.tensor_shape("blk.0.ffn_gate_exps.weight")
    shared = meta.tensor_shape("blk.0.ffn_gate_shexp.weight")
    config.moe_intermediate_size = int(meta.arch_get("expert_feed_forward_length")
                                       or (routed[1] if routed else 0))
    config.shared_expert_intermediate_size = int(
        meta.arch_get("expert_shared_feed_forward_length") or (shared[0] if shared else 0))


QWEN2 = GGUFArch("qwen2", DECODER_LAYER_NAMES, fixed_attention_bias=True)
QWEN2MOE = GGUFArch("qwen2moe", _MOE_LAYER, fixed_attention_bias=True,
                    experts={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                             "ffn_down_exps": "down_proj"},
                    row_vectors=frozenset({"mlp.shared_expert_gate"}),
                    complete_config=_complete_moe)
QWEN3 = GGUFArch("qwen3", DECODER_LAYER_NAMES)
