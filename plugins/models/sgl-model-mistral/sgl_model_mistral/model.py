"""Mistral: the Llama decoder whose attention may be limited to a sliding window.

Same maths as ``transformers``' ``MistralForCausalLM``: every layer attends to the last
``config.sliding_window`` tokens (None: full attention). ``head_dim`` may differ from
``hidden_size / num_attention_heads`` (Mistral NeMo).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_model_llama.decoder import DecoderForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["MistralForCausalLM"]


class MistralForCausalLM(DecoderForCausalLM):
    """``MistralForCausalLM`` checkpoints (Mistral 7B v0.1-v0.3, Mistral NeMo, ...)."""

    @classmethod
    def sliding_window(cls, config: PretrainedConfig, layer_id: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        if window is not None and int(window) < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or null, "
                             f"got {window}")
        return None if window is None else int(window)
