"""LongRoPE (Phi-3 / Phi-4-mini ``rope_type: longrope``): per-frequency rescaling with one factor
set for short sequences and another for long ones.

Transformers picks the set per forward call: the long factors when the sequence, counting the
tokens of this call, is longer than ``original_max_position_embeddings``. sgl makes the same
choice per sequence of a batch, so a request gets what it would get alone in transformers (keys
cached while the sequence was short keep their short-factor rotation, as there).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sgl.layers.rotary import RotaryEmbedding

__all__ = ["LongRopeRotaryEmbedding", "longrope_attention_factor", "longrope_inv_freq"]


def longrope_inv_freq(rotary_dim: int, params: dict[str, Any], *, long: bool) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32) with the short or long factors."""
    factors = params["long_factor" if long else "short_factor"]
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} "
                         f"entries; expected rotary_dim / 2 = {rotary_dim // 2}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    scale = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (scale * float(params["rope_theta"]) ** exponents)


def longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """The magnitude scale of cos/sin: ``attention_factor`` if given, else
    ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` defaulting to
    ``max_position / original`` (1 when the context is not extended)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_position / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """The cos/sin cache holds two tables: rows ``[0, max_position)`` with the short factors and
    ``[max_position, 2 max_position)`` with the long ones. Models pass the rows returned by
    :meth:`cache_positions` instead of plain positions."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 params: dict[str, Any], *, device: torch.device | str | None = None) -> None:
        if params.get("original_max_position_embeddings") is None:
            raise ValueError("longrope needs original_max_position_embeddings in the config")
        # the parent validates the shapes and sets everything up; its single (unscaled)
        # frequency table is then replaced by the short and long tables
        super().__init__(head_dim, rotary_dim, max_position,
                         {"rope_type": "default", "rope_theta": params["rope_theta"]},
                         device=device)
        self.max_position = max_position
        self.original_max_position = int(params["original_max_position_embeddings"])
        mscale = longrope_attention_factor(params, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)
        tables = []
        for long in (False, True):
            freqs = torch.outer(positions, longrope_inv_freq(rotary_dim, params, long=long))
            tables.append(torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1))
        self.register_buffer("cos_sin", torch.cat(tables).to(self.cos_sin.device),
                             persistent=False)

    def cache_positions(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                        extend_seq_lens: torch.Tensor) -> torch.Tensor:
        """Cache rows for the new tokens: a sequence whose length after this pass
        (``seq_lens``) exceeds ``original_max_position_embeddings`` uses the long table.

        :param positions: ``[num_tokens]`` positions of the new tokens, sequence by sequence
        :param extend_seq_lens: ``[batch]`` new tokens of each sequence
        """
        long = (seq_lens > self.original_max_position).to(positions.dtype)
        return positions + long.repeat_interleave(extend_seq_lens) * self.max_position
