"""The arguments of flashinfer's paged attention wrappers for one :class:`ForwardBatch`, in plain
torch (no flashinfer import, so all of it runs and is tested on CPU).

sgl's KV pool is one tensor per layer, ``k_buffer[layer]: [size + 1, num_kv_heads, head_dim]``,
slot 0 being padding. Viewed as ``[size + 1, 1, num_kv_heads, head_dim]`` it is flashinfer's
paged cache in the ``NHD`` layout with pages of one token: page ``p`` is slot ``p``. Then, for
sequence ``b`` of the batch (flashinfer's documented meaning of each array):

- ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` are its pages in order, i.e.
  ``req_to_token[row_b, :seq_len_b]`` (cached prefix, then the new tokens);
- ``kv_last_page_len[b]`` is how many entries its last page holds: always 1, so its KV length
  is ``(kv_indptr[b + 1] - kv_indptr[b] - 1) * page_size + kv_last_page_len[b] = seq_len_b``;
- ``qo_indptr[b]:qo_indptr[b + 1]`` are its new tokens' rows of ``q`` (prefill wrapper only);
- ``custom_mask`` (prefill, token trees only) is flat: for each sequence in turn its
  ``[qo_len, kv_len]`` boolean matrix, row-major, True where new token i sees key j.

Layer-dependent arguments come from the :class:`~sgl.attention.AttentionLayerSpec`:
``window_left = sliding_window - 1`` (flashinfer keeps key ``j`` for the query at position
``p`` when ``p - j <= window_left``; sgl's window keeps ``p - j < sliding_window``), ``-1``
without a window; ``logits_soft_cap`` (0 means none); ``sm_scale = spec.scaling``.

The plan arguments are the ones of ``BatchDecodeWithPagedKVCacheWrapper.plan`` and
``BatchPrefillWithPagedKVCacheWrapper.plan`` in flashinfer 0.6.18 (unchanged since 0.2.0 for the
arguments used here): seven (decode) or eight (prefill) positional arrays and sizes, the rest by
keyword.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl.forward_batch import ForwardMode

if TYPE_CHECKING:
    from sgl.attention.base import AttentionLayerSpec
    from sgl.forward_batch import ForwardBatch

__all__ = [
    "PAGE_SIZE",
    "SUPPORTED_DTYPES",
    "LayerKind",
    "PagedKVPlan",
    "check_dtypes",
    "decode_plan_args",
    "layer_kind",
    "paged_kv_cache",
    "plan_paged_kv",
    "prefill_plan_args",
    "window_left",
]

#: the query and KV dtypes flashinfer's attention kernels take (no float32)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: the page size sgl's pool has when flashinfer views it (one token per page)
PAGE_SIZE = 1


@dataclass(frozen=True)
class PagedKVPlan:
    """The layer-independent plan arguments of one batch.

    The small arrays (``qo_indptr``, ``kv_indptr``, ``kv_last_page_len``) are built on the host
    from the batch's Python lists, which is where flashinfer's ``plan`` reads them anyway;
    ``kv_indices`` and ``custom_mask`` are built on ``req_to_token``'s device."""

    mode: ForwardMode
    qo_indptr: torch.Tensor  # int32 [batch + 1], host
    kv_indptr: torch.Tensor  # int32 [batch + 1], host
    kv_indices: torch.Tensor  # int32 [kv_indptr[-1]], pool slots = pages
    kv_last_page_len: torch.Tensor  # int32 [batch], host, all 1
    #: bool [sum(qo_len * kv_len)] for a batch with token trees, else None (causal)
    custom_mask: torch.Tensor | None = None
    page_size: int = PAGE_SIZE

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.shape[0])

    @property
    def causal(self) -> bool:
        return self.custom_mask is None


@dataclass(frozen=True)
class LayerKind:
    """What makes two layers need different plans: flashinfer's ``plan`` fixes the heads, the
    window, the soft-cap and the softmax scale for every ``run`` after it."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int  # -1: no window
    logits_soft_cap: float  # 0.0: none
    sm_scale: float


def window_left(sliding_window: int | None) -> int:
    """flashinfer's ``window_left`` for sgl's ``sliding_window`` (at most that many keys, the
    query's own included): ``sliding_window - 1``, or -1 for none."""
    if sliding_window is None:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return sliding_window - 1


def layer_kind(spec: AttentionLayerSpec) -> LayerKind:
    return LayerKind(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                     window_left(spec.sliding_window), float(spec.logit_softcap or 0.0),
                     float(spec.scaling))


def check_dtypes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Raise ``ValueError`` naming the fix when flashinfer's kernels cannot take these dtypes."""
    for what, dtype in (("query", q_dtype), ("KV cache", kv_dtype)):
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"the flashinfer attention backend takes {names}, the {what} is "
                             f"{str(dtype).removeprefix('torch.')}: serve with --dtype bfloat16 "
                             "(or float16), or use --attention-backend torch")


def _cpu_list(values: list[int], tensor: torch.Tensor) -> list[int]:
    return list(values) if values else [int(x) for x in tensor.tolist()]


def _indptr(lengths: list[int]) -> torch.Tensor:
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return indptr


def _tree_mask(batch: ForwardBatch, prefix_lens: list[int], new_lens: list[int],
               device: torch.device) -> torch.Tensor:
    """The flat custom mask of an extend batch with token trees: a tree's token i sees the
    whole prefix and the new tokens j where ``tree[i, j]``; a chain beside it is causal."""
    parts = []
    trees = batch.tree_masks or [None] * len(new_lens)
    for prefix, n, tree in zip(prefix_lens, new_lens, trees):
        if tree is None:
            visible = torch.ones(n, prefix + n, dtype=torch.bool, device=device).tril(prefix)
        else:
            if tuple(tree.shape) != (n, n):
                raise ValueError(f"a tree mask of shape {tuple(tree.shape)} for {n} new tokens")
            visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device),
                                 tree.to(device=device, dtype=torch.bool)], dim=1)
        parts.append(visible.reshape(-1))
    return torch.cat(parts)


def plan_paged_kv(batch: ForwardBatch, req_to_token: torch.Tensor) -> PagedKVPlan:
    """The index arrays of ``batch`` (see the module docstring), with one gather from
    ``req_to_token`` and no copy of a device tensor to the host."""
    seq_lens = _cpu_list(batch.seq_lens_cpu, batch.seq_lens)
    if batch.mode == ForwardMode.DECODE:
        new_lens = [1] * len(seq_lens)
    else:
        new_lens = _cpu_list(batch.extend_seq_lens_cpu, batch.extend_seq_lens)
    prefix_lens = [total - n for total, n in zip(seq_lens, new_lens)]
    if len(new_lens) != len(seq_lens) or min(prefix_lens, default=0) < 0:
        raise ValueError(f"inconsistent batch: seq_lens {seq_lens}, new tokens {new_lens}")
    device = req_to_token.device
    kv_indptr = _indptr(seq_lens)
    total = int(kv_indptr[-1])
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    rows = batch.req_pool_indices.to(device=device, dtype=torch.int64)
    token_rows = rows.repeat_interleave(lens, output_size=total)
    starts = kv_indptr[:-1].to(device=device, dtype=torch.int64)
    columns = torch.arange(total, device=device) - starts.repeat_interleave(lens,
                                                                            output_size=total)
    kv_indices = req_to_token[token_rows, columns].to(torch.int32)
    custom_mask = None
    if batch.tree_masks is not None and any(t is not None for t in batch.tree_masks):
        if batch.mode != ForwardMode.EXTEND:
            raise ValueError("token trees are only attended in extend batches")
        custom_mask = _tree_mask(batch, prefix_lens, new_lens, device)
    return PagedKVPlan(batch.mode, _indptr(new_lens), kv_indptr, kv_indices,
                       torch.ones(len(seq_lens), dtype=torch.int32), custom_mask)


def decode_plan_args(plan: PagedKVPlan, kind: LayerKind, q_dtype: torch.dtype,
                     kv_dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``BatchDecodeWithPagedKVCacheWrapper.plan`` (whatever the dtypes:
    :func:`check_dtypes` is the backend's)."""
    args = (plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, kind.num_qo_heads,
            kind.num_kv_heads, kind.head_dim, plan.page_size)
    kwargs = {"window_left": kind.window_left, "logits_soft_cap": kind.logits_soft_cap,
              "q_data_type": q_dtype, "kv_data_type": kv_dtype, "sm_scale": kind.sm_scale}
    return args, kwargs


def prefill_plan_args(plan: PagedKVPlan, kind: LayerKind, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``BatchPrefillWithPagedKVCacheWrapper.plan``: causal, or the
    custom mask of a batch with token trees (which takes no sliding window, as in the torch
    backend: a tree token's position is its depth, not its index, so flashinfer's window,
    counted in indices, would cut the wrong keys)."""
    if plan.custom_mask is not None and kind.window_left >= 0:
        raise ValueError("token trees with a sliding window are not supported")
    args = (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len,
            kind.num_qo_heads, kind.num_kv_heads, kind.head_dim, plan.page_size)
    kwargs = {"custom_mask": plan.custom_mask, "causal": plan.causal,
              "window_left": kind.window_left, "logits_soft_cap": kind.logits_soft_cap,
              "sm_scale": kind.sm_scale, "q_data_type": q_dtype, "kv_data_type": kv_dtype}
    return args, kwargs


def paged_kv_cache(k_buffer: torch.Tensor,
                   v_buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's pool as flashinfer's ``(k_cache, v_cache)``, ``NHD`` with pages of one token:
    ``[size + 1, 1, num_kv_heads, head_dim]`` views, no copy."""
    return (k_buffer.view(k_buffer.shape[0], PAGE_SIZE, *k_buffer.shape[1:]),
            v_buffer.view(v_buffer.shape[0], PAGE_SIZE, *v_buffer.shape[1:]))
