"""Token embedding and LM head, split over tensor-parallel ranks along the vocabulary.

Built inside :func:`sgl.layers.quantized.deferred_weights`, both hold their table as it arrives
(a GGUF file's ``Q8_0`` embedding stays ``Q8_0``): rows are then looked up with
``sgl::embedding_q`` and the LM head multiplies with the quantized matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl.kernels import cpu, ops
from sgl.kernels.library import PackedWeight
from sgl.layers.packed_linear import linear, pack_weight
from sgl.layers.quantized import (
    embedding_layout,
    init_weight,
    pack_round_x_weight,
    quantized_linear,
    store_weight_rows,
    widen_q6_weight,
    zero_weight_rows,
)
from sgl.layers.tp import get_tp_group, tp_all_gather, tp_all_reduce

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


#: the ``scales`` argument of ``sgl::embedding_q`` for a table in a packed layout
_NO_SCALES = torch.empty(0, dtype=torch.float16)


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds rows ``[r * per_rank, (r + 1) * per_rank)`` of the embedding table
    (the last rank's tail is zero padding when the vocabulary does not divide evenly).

    ``scale`` multiplies the looked-up rows (Gemma: ``sqrt(hidden_size)``), rounded to ``dtype``
    first as the reference implementations do."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.scale = None if scale is None else float(
            torch.tensor(scale, dtype=dtype or torch.get_default_dtype()))
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.per_rank = -(-num_embeddings // self.tp.size)
        self.vocab_start = self.tp.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        init_weight(self, self.per_rank, embedding_dim, dtype, device, self.weight_loader)
        #: LM heads tied to this table (they follow it when it is allocated on loading)
        self.tied_heads: list[ParallelLMHead] = []

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding: expected shape {(self.num_embeddings, self.embedding_dim)}, got "
                f"{tuple(loaded.shape)}"
            )
        rows = self.vocab_end - self.vocab_start
        quantize_as = embedding_layout(self.weight_mode)
        store_weight_rows(self, 0, loaded.narrow(0, self.vocab_start, rows), "embedding",
                          quantize_as=quantize_as)
        zero_weight_rows(self, rows)

    def process_weights_after_loading(self) -> None:
        """A table shared with LM heads that round x to int8 takes their packed layout
        (:func:`~sgl.layers.quantized.pack_round_x_weight`; rows are looked up in it); a q6
        table on CPU that is not packed becomes q8, which the lookup kernel takes."""
        if self.tied_heads:
            pack_round_x_weight(self)
        elif self.weight.device.type == "cpu":
            widen_q6_weight(self)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_layout is None:
            out = _cpu_embedding(ids, self.weight)
            return F.embedding(ids, self.weight) if out is None else out
        dtype = self.weight_dtype
        # a packed layout (on CPU) has its scales in its blocks
        scales = self.weight_scales if self.weight_scales is not None else _NO_SCALES
        if ids.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            return torch.ops.sgl.embedding_q(self.weight, scales, ids.reshape(-1),
                                             dtype).view(*ids.shape, -1)
        return ops.embedding_q(self.weight, scales, ids.reshape(-1), dtype).view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = self._lookup(input_ids)
        else:
            outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
            local = torch.where(outside, 0, input_ids - self.vocab_start)
            out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0)
            out = tp_all_reduce(out)
        return out if self.scale is None else out * self.scale


def _cpu_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``weight[ids]`` for flat int64 ids through sgl's CPU kernel (row copies, no torch op, so
    the CPU kernel library's decode graphs can replay it), else None."""
    if (ids.device.type != "cpu" or ids.dim() != 1 or ids.dtype != torch.int64
            or not ids.is_contiguous() or not cpu.fits(weight)):
        return None
    return None if cpu.load() is None else torch.ops.sgl.embedding(weight, ids)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``hidden -> logits``; may share its weight with the embedding.

    ``logit_softcap`` applies ``cap * tanh(logits / cap)`` to the float32 logits (Gemma 2)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.logit_softcap = logit_softcap or None  # 0 means none, as in some configs
        self.packed: PackedWeight | None = None
        #: whether the weight is an embedding's (:meth:`tie_to`)
        self.tied = False
        #: float32 ``[rows, vocab]``: while set, :meth:`forward` writes its logits into the
        #: first rows and returns them, instead of a new tensor (``ModelRunner.logits_at`` with
        #: ``reuse``)
        self.logits_scratch: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """Pack the (possibly tied) weight for the CPU matmul (:mod:`sgl.layers.packed_linear`);
        a quantized one is multiplied as it is, or in the packed layout of its integer products
        (:func:`~sgl.layers.quantized.pack_round_x_weight`; a tied table is packed by its
        embedding, which this head follows)."""
        if self.weight_layout is None:
            self.packed = pack_weight(self.weight)
            return
        self.packed = None
        if not self.tied:
            pack_round_x_weight(self)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s weight (tied input and output embeddings)."""
        self.tied = True
        self.weight = embedding.weight
        self.weight_scales, self.weight_layout = embedding.weight_scales, embedding.weight_layout
        embedding.tied_heads.append(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[n, hidden] -> [n, vocab]`` float32 logits over the full vocabulary."""
        if self.weight_layout is not None:
            logits = quantized_linear(hidden, self.weight_layout, self.weight,
                                      self.weight_scales, None,
                                      round_x=self.round_x)
        else:
            logits = linear(hidden, self.weight, None, self.packed)
        logits = tp_all_gather(logits, dim=-1)[..., :self.num_embeddings]
        scratch = self.logits_scratch
        if (scratch is not None and logits.dim() == 2 and logits.shape[0] <= scratch.shape[0]
                and logits.shape[1] == scratch.shape[1]):
            logits = scratch[:logits.shape[0]].copy_(logits)
        else:
            logits = logits.float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
