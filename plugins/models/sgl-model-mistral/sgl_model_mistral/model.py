"""Mistral: the Llama decoder whose attention may be limited to a sliding window.

Same maths as ``transformers``' ``MistralForCausalLM``: every layer attends to the last
``config.sliding_window`` tokens (None: full attention). ``head_dim`` may differ from
``hidden_size / num_attention_heads`` (Mistral NeMo).
"""

from __future__ import annotations

from sgl_model_llama.decoder import DecoderForCausalLM

__all__ = ["MistralForCausalLM"]


class MistralForCausalLM(DecoderForCausalLM):
    """``MistralForCausalLM`` checkpoints (Mistral 7B v0.1-v0.3, Mistral NeMo, ...)."""

    window_on_every_layer = True
