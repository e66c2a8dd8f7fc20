"""The ``toy`` attention backend: sgl's torch backend, plus a log line on the first batch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sgl.attention import BaseAttentionBackend
from sgl_attn_torch.backend import TorchAttentionBackend

if TYPE_CHECKING:
    import torch

    from sgl.attention import AttentionLayerSpec
    from sgl.forward_batch import ForwardBatch

logger = logging.getLogger("sgl_hello")


class ToyAttentionBackend(BaseAttentionBackend):
    name = "toy"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = TorchAttentionBackend(**kwargs)
        self.batches = 0

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.batches += 1
        if self.batches == 1:
            logger.info("toy attention backend: first batch, %d tokens", batch.num_tokens)
        self.inner.init_forward_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self.inner.forward(q, k, v, layer, batch)
