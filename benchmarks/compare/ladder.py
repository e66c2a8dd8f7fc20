"""The ladder: random-weight models of published shapes, 0.5B to 8B parameters and one MoE.

Each rung is a ``transformers`` config of a published model's shape (hidden size, layers, heads,
KV heads, MLP and expert sizes, tied or untied embeddings) with SmolLM2's tokenizer and its
49152-token vocabulary, so every rung reads the same prompts as the bundled model. Speed does not
depend on the values, so the weights are drawn at random: bfloat16, normal with std 0.02, the
norm weights 1 (as ``transformers`` initialises them). :func:`random_tensors` yields them tensor
by tensor in checkpoint order and names, so a writer holds one shard at a time, never the model
(the 8B rung is 16 GB).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

STD = 0.02
#: every rung's ``max_position_embeddings``: the benchmark's sequences are far shorter, and a
#: published 32k-128k context would make vLLM reserve KV for one whole sequence at start-up.
#: For the same reason (it changes no cost) Llama 3's rope scaling is left out.
CONTEXT = 8192


@dataclass(frozen=True)
class Rung:
    """A published model's shape.

    :param source: the model whose config.json the shape is taken from.
    :param config_class: the ``transformers`` config class; ``architecture`` the model class.
    :param published_params: the source's parameter count (its model card), embeddings included.
    :param published_vocab: the source's vocabulary (a rung has SmolLM2's 49152 instead).
    """

    source: str
    config_class: str
    architecture: str
    published_params: float
    published_vocab: int
    shape: dict[str, Any] = field(default_factory=dict)


# Sources: the config.json of each model on the Hugging Face Hub (Qwen/Qwen2.5-0.5B,
# meta-llama/Llama-3.2-1B, meta-llama/Llama-3.2-3B, meta-llama/Llama-3.1-8B,
# Qwen/Qwen1.5-MoE-A2.7B); parameter counts from their model cards.
LADDER: dict[str, Rung] = {
    "qwen2.5-0.5b": Rung("Qwen/Qwen2.5-0.5B", "Qwen2Config", "Qwen2ForCausalLM", 0.49e9, 151936,
                         dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, intermediate_size=4864,
                              tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama-3.2-1b": Rung("meta-llama/Llama-3.2-1B", "LlamaConfig", "LlamaForCausalLM", 1.23e9,
                         128256,
                         dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, intermediate_size=8192,
                              tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "llama-3.2-3b": Rung("meta-llama/Llama-3.2-3B", "LlamaConfig", "LlamaForCausalLM", 3.21e9,
                         128256,
                         dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                              num_key_value_heads=8, intermediate_size=8192,
                              tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "llama-3.1-8b": Rung("meta-llama/Llama-3.1-8B", "LlamaConfig", "LlamaForCausalLM", 8.03e9,
                         128256,
                         dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, intermediate_size=14336,
                              tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen2-moe-a2.7b": Rung("Qwen/Qwen1.5-MoE-A2.7B", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                            14.3e9, 151936,
                            dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                 num_key_value_heads=16, intermediate_size=5632,
                                 moe_intermediate_size=1408,
                                 shared_expert_intermediate_size=5632, num_experts=60,
                                 num_experts_per_tok=4, tie_word_embeddings=False,
                                 rope_theta=1e6, rms_norm_eps=1e-6)),
}


def ladder_config(name: str, *, vocab_size: int, bos_token_id: int, eos_token_id: int,
                  **overrides: Any) -> PretrainedConfig:
    """The config of rung ``name`` with the given vocabulary; ``overrides`` (config fields)
    shrink it in tests."""
    import torch
    import transformers

    rung = LADDER[name]
    config_class = getattr(transformers, rung.config_class)
    config = config_class(**{**rung.shape, "max_position_embeddings": CONTEXT,
                             "vocab_size": vocab_size, "bos_token_id": bos_token_id,
                             "eos_token_id": eos_token_id, **overrides})
    config.architectures = [rung.architecture]
    config.dtype = torch.bfloat16
    return config


def _checkpoint_shapes(config: PretrainedConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's Hugging Face checkpoint name and shape, in order (the MoE's experts one by
    one, as checkpoints store them, not fused as ``transformers`` 5 holds them in memory)."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    qwen = config.model_type.startswith("qwen2")  # Qwen2 and Qwen2-MoE: q/k/v biases
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        for proj, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
            yield f"{p}self_attn.{proj}_proj.weight", (rows, h)
            if qwen:
                yield f"{p}self_attn.{proj}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, heads * head_dim)
        yield p + "post_attention_layernorm.weight", (h,)
        if config.model_type == "qwen2_moe":
            yield p + "mlp.gate.weight", (config.num_experts, h)
            experts = [f"experts.{e}" for e in range(config.num_experts)]
            for mlp, size in [(x, config.moe_intermediate_size) for x in experts] + [
                    ("shared_expert", config.shared_expert_intermediate_size)]:
                yield f"{p}mlp.{mlp}.gate_proj.weight", (size, h)
                yield f"{p}mlp.{mlp}.up_proj.weight", (size, h)
                yield f"{p}mlp.{mlp}.down_proj.weight", (h, size)
            yield p + "mlp.shared_expert_gate.weight", (1, h)
        else:
            yield p + "mlp.gate_proj.weight", (config.intermediate_size, h)
            yield p + "mlp.up_proj.weight", (config.intermediate_size, h)
            yield p + "mlp.down_proj.weight", (h, config.intermediate_size)
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)


def random_tensors(config: PretrainedConfig, seed: int = 0
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a random bfloat16 checkpoint of ``config``, one tensor at a time."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for name, shape in _checkpoint_shapes(config):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.bfloat16)
        else:
            yield name, torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, STD,
                                                                         generator=generator)
