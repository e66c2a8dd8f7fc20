"""``TritonAttentionBackend``: decode and extend attention over the paged KV pool with the triton
kernels of :mod:`sgl_attn_triton.kernels`, on CUDA GPUs.

Each layer first writes its new keys and values into the pool at ``batch.out_cache_loc``
(plain torch indexing), then runs one kernel launch (extend) or two (decode: split-K, then the
merge) that read every key and value from the pool through ``req_to_token``. Nothing in a
decode forward reads a tensor back to the host, and its launch grids depend only on the batch
size and the head counts: a decode forward can be captured in a CUDA graph, with
:meth:`TritonAttentionBackend.graph_inputs` naming the tensors a replay must refresh.

On a CPU the kernels run only under triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests check them; it is far too slow to serve with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.attention.base import AttentionLayerSpec, BaseAttentionBackend
from sgl.forward_batch import ForwardMode
from sgl_attn_triton.kernels import (DECODE_SPLITS, INTERPRETED_DECODE_SPLITS,
                                     decode_attention, extend_attention, interpreting)

if TYPE_CHECKING:
    from sgl.forward_batch import ForwardBatch
    from sgl.kvcache.pool import KVPool, ReqToTokenPool

__all__ = ["DTYPES", "TritonAttentionBackend", "TritonAttentionMetadata"]

#: the query and KV-cache dtypes the kernels take (they accumulate in float32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class TritonAttentionMetadata:
    """What :meth:`TritonAttentionBackend.init_forward_metadata` plans once per batch: the
    int64 device tensors the kernels read."""

    mode: ForwardMode
    rows: torch.Tensor  # [batch] req_to_token rows
    seq_lens: torch.Tensor  # [batch] prefix + new tokens
    out_cache_loc: torch.Tensor  # [tokens] pool slots of the new tokens
    # extend only
    q_starts: torch.Tensor | None = None  # [batch] first row of each sequence in q
    prefix_lens: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    max_extend: int = 0
    tree: torch.Tensor | None = None  # uint8, the token trees' masks flattened
    tree_starts: torch.Tensor | None = None  # [batch] offset of each mask in ``tree``, or -1


class TritonAttentionBackend(BaseAttentionBackend):
    """Extend and decode attention for ragged batches: GQA, sliding window, soft-capping and
    token trees.

    :param decode_splits: key ranges per sequence in decode, a power of two; default
        :data:`~sgl_attn_triton.kernels.DECODE_SPLITS` on a GPU, fewer in the interpreter
    """

    name = "triton"
    supports_tree_mask = True

    def __init__(self, *, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 device: torch.device, decode_splits: int | None = None) -> None:
        device = torch.device(device)
        super().__init__(kv_pool=kv_pool, req_to_token_pool=req_to_token_pool, device=device)
        if device.type == "cpu" and not interpreting():
            raise RuntimeError(
                "the triton attention backend runs on CUDA GPUs, not on the CPU: use "
                "--attention-backend torch on a CPU (or set TRITON_INTERPRET=1 to run its "
                "kernels in triton's interpreter, for testing)")
        if device.type not in ("cuda", "cpu"):
            raise RuntimeError(f"the triton attention backend runs on CUDA GPUs, not on "
                               f"{device.type!r}; use --attention-backend torch")
        if kv_pool.dtype not in DTYPES:
            raise ValueError(f"the triton attention backend takes a KV cache in "
                             f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}, "
                             f"not {str(kv_pool.dtype).removeprefix('torch.')}")
        if decode_splits is None:  # the interpreter runs the programs one after another
            decode_splits = INTERPRETED_DECODE_SPLITS if interpreting() else DECODE_SPLITS
        if decode_splits < 1 or decode_splits & (decode_splits - 1):
            raise ValueError(f"decode_splits must be a power of two, got {decode_splits}")
        self.decode_splits = decode_splits

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        plan = TritonAttentionMetadata(batch.mode, batch.req_pool_indices.contiguous(),
                                       batch.seq_lens.contiguous(),
                                       batch.out_cache_loc.contiguous())
        if batch.mode == ForwardMode.EXTEND:
            self._plan_extend(plan, batch)
        batch.attn_metadata = plan

    def _plan_extend(self, plan: TritonAttentionMetadata, batch: ForwardBatch) -> None:
        """The host-side plan of an extend batch (extend forwards are never captured)."""
        extend = batch.extend_seq_lens_cpu or [int(n) for n in batch.extend_seq_lens.tolist()]
        prefix = batch.extend_prefix_lens_cpu or [
            int(n) for n in batch.extend_prefix_lens.tolist()]
        starts = [0]
        for n in extend[:-1]:
            starts.append(starts[-1] + n)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        plan.q_starts, plan.prefix_lens = as_tensor(starts), as_tensor(prefix)
        plan.extend_lens, plan.max_extend = as_tensor(extend), max(extend, default=0)
        if batch.tree_masks is not None and any(m is not None for m in batch.tree_masks):
            masks, offsets, offset = [], [], 0
            for mask, n in zip(batch.tree_masks, extend):
                if mask is None:
                    offsets.append(-1)
                    continue
                if tuple(mask.shape) != (n, n):
                    raise ValueError(f"a tree mask over {n} new tokens must be [{n}, {n}], "
                                     f"got {list(mask.shape)}")
                masks.append(mask.to(self.device, torch.uint8).reshape(-1))
                offsets.append(offset)
                offset += n * n
            plan.tree, plan.tree_starts = torch.cat(masks), as_tensor(offsets)

    def graph_inputs(self, batch: ForwardBatch) -> list[torch.Tensor] | None:
        """A decode batch: its rows, lengths and new slots, which the kernels and the KV write
        read. (On the CPU, under the interpreter, sgl's CPU graph runner tries once per batch
        size to record the forward and keeps it eager: the KV write is a torch op.)"""
        plan = batch.attn_metadata
        if not isinstance(plan, TritonAttentionMetadata) or plan.mode != ForwardMode.DECODE:
            return None
        return [plan.rows, plan.seq_lens, plan.out_cache_loc]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        plan = batch.attn_metadata
        if not isinstance(plan, TritonAttentionMetadata):
            raise RuntimeError("init_forward_metadata(batch) must run before the first layer")
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(f"{layer.num_heads} query heads cannot share "
                             f"{layer.num_kv_heads} KV heads evenly")
        tokens = q.shape[0]
        k = k.view(tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(tokens, layer.num_kv_heads, -1)
        self.kv_pool.set_kv(layer.layer_id, plan.out_cache_loc, k, v)
        q = q.reshape(tokens, layer.num_heads, layer.head_dim)
        if q.stride(-1) != 1:
            q = q.contiguous()
        k_pool = self.kv_pool.k_buffer[layer.layer_id]
        v_pool = self.kv_pool.v_buffer[layer.layer_id]
        table = self.req_to_token_pool.req_to_token
        options = {"scale": layer.scaling, "softcap": layer.logit_softcap,
                   "window": layer.sliding_window}
        if plan.mode == ForwardMode.DECODE:
            out = decode_attention(q, k_pool, v_pool, table, plan.rows,
                                   plan.seq_lens, splits=self.decode_splits, **options)
        else:
            if plan.tree is not None and layer.sliding_window:
                raise ValueError("token trees with a sliding window are not supported")
            out = extend_attention(q, k_pool, v_pool, table, plan.rows,
                                   plan.q_starts, plan.prefix_lens, plan.extend_lens,
                                   plan.max_extend, tree=plan.tree,
                                   tree_starts=plan.tree_starts, **options)
        return out.view(tokens, -1)
