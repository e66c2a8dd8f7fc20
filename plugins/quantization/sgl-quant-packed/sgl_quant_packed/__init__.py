"""Checkpoints whose linear weights are packed integers: GPTQ, AWQ and compressed-tensors
(:mod:`sgl_quant_packed.formats`)."""

__all__: list[str] = []
