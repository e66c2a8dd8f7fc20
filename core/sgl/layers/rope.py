"""The rotary embedding a model's config describes: :class:`~sgl.layers.rotary.RotaryEmbedding`
or, for ``rope_type: longrope``, :class:`~sgl.layers.longrope.LongRopeRotaryEmbedding`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.layers.longrope import LongRopeRotaryEmbedding
from sgl.layers.rotary import RotaryEmbedding, rope_parameters

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["get_rope"]


def get_rope(config: PretrainedConfig, head_dim: int, *,
             device: torch.device | str | None = None,
             layer_type: str = "full_attention") -> RotaryEmbedding:
    """The rotary embedding ``config`` describes, cached for ``max_position_embeddings``.

    Partial rotary (``partial_rotary_factor``) rotates the first features of each head only;
    ``layer_type`` is as for :func:`rope_parameters`."""
    params = rope_parameters(config, layer_type=layer_type)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * float(partial or 1.0))
    max_position = int(config.max_position_embeddings)
    if params["rope_type"] == "longrope":
        original = params.get("original_max_position_embeddings",
                              getattr(config, "original_max_position_embeddings", None))
        return LongRopeRotaryEmbedding(head_dim, rotary_dim, max_position,
                                       {**params, "original_max_position_embeddings": original},
                                       device=device)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, params, device=device)
