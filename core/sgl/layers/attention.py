"""The attention layer models call: it forwards to whichever backend the runner chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from sgl.attention.base import AttentionLayerSpec

if TYPE_CHECKING:
    import torch

    from sgl.forward_batch import ForwardBatch

__all__ = ["Attention"]


class Attention(nn.Module):
    """Holds the layer's :class:`AttentionLayerSpec`; has no weights."""

    def __init__(self, *, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float | None = None, sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim ** -0.5 if scaling is None else scaling,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Flat ``q``/``k``/``v`` of the new tokens -> ``[num_tokens, num_heads * head_dim]``."""
        return batch.attn_backend.forward(q, k, v, self.spec, batch)
