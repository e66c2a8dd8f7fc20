"""Llama: the decoder of :mod:`sgl_model_llama.decoder` with its defaults.

Same maths as ``transformers``' ``LlamaForCausalLM``; ``attention_bias`` puts a bias on q/k/v
and the output projection, ``mlp_bias`` on the MLP's projections.
"""

from __future__ import annotations

from sgl_model_llama.decoder import DecoderForCausalLM

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    """``LlamaForCausalLM`` checkpoints (Llama 2/3, SmolLM2, ...)."""
