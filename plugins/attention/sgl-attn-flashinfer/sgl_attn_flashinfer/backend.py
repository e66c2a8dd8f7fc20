"""``FlashInferAttentionBackend``: sgl's attention on flashinfer's paged wrappers (NVIDIA GPUs).

The KV pool is handed to flashinfer as it is, as a paged cache of one-token pages in the
``NHD`` layout (:func:`~sgl_attn_flashinfer.planning.paged_kv_cache`), so nothing is copied:

- decode batches run ``BatchDecodeWithPagedKVCacheWrapper`` (with tensor cores when four or
  more query heads share a KV head, as SGLang does);
- extend batches (prefill on a cached prefix, token trees) run
  ``BatchPrefillWithPagedKVCacheWrapper``, causal, or with the flat custom mask of the trees.

:meth:`init_forward_metadata` builds the layer-independent index arrays once per batch
(:func:`~sgl_attn_flashinfer.planning.plan_paged_kv`). flashinfer's ``plan`` also fixes the
heads, the sliding window, the soft-cap and the softmax scale, which the backend learns only
from each layer's :class:`~sgl.attention.AttentionLayerSpec` in :meth:`forward`: the first layer
of each distinct kind in a batch plans that kind's wrapper, the later layers of the kind reuse
it. A model with one kind (Llama) plans once per batch, Gemma 2/3 (local and global layers)
twice. Every wrapper shares one workspace buffer, allocated on the device when the backend is
built.

flashinfer is imported when the backend is built, never by the plugin module.

CUDA graphs (:mod:`sgl.engine.cuda_graph`): a captured graph reads fixed addresses, while
flashinfer's ``plan`` is host code that must run before every replay. So a decode batch whose
:meth:`graph_inputs` is asked for (the runner asks right after :meth:`init_forward_metadata`, at
capture and before each replay) is planned into graph-mode wrappers of its batch size
(``use_cuda_graph=True``, index buffers fixed when they are made), for every layer kind seen so
far; ``plan`` copies the batch's indices into those buffers, which the captured ``run`` reads.
There is then nothing for the runner to copy: :meth:`graph_inputs` returns an empty list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgl.attention.base import AttentionLayerSpec, BaseAttentionBackend
from sgl.forward_batch import ForwardMode
from sgl_attn_flashinfer.planning import (
    LayerKind,
    PagedKVPlan,
    check_dtypes,
    decode_plan_args,
    layer_kind,
    paged_kv_cache,
    plan_paged_kv,
    prefill_plan_args,
)

if TYPE_CHECKING:
    from types import ModuleType

    from sgl.forward_batch import ForwardBatch
    from sgl.kvcache.pool import KVPool, ReqToTokenPool

__all__ = ["WORKSPACE_BYTES", "FlashInferAttentionBackend", "FlashInferMetadata"]

#: the float workspace every wrapper shares (flashinfer's recommended size)
WORKSPACE_BYTES = 128 * 1024 * 1024
#: query heads per KV head from which decode runs on tensor cores
TENSOR_CORE_GROUP = 4


def import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except ImportError as exc:
        from sgl_attn_flashinfer.plugin import unavailable

        raise ImportError(f"the flashinfer attention backend cannot start: "
                          f"{unavailable() or exc}") from exc
    return flashinfer


#: what one plan depends on besides the batch: the layer kind, the query and the KV dtypes
PlanKey = tuple[LayerKind, torch.dtype, torch.dtype]


@dataclass
class FlashInferMetadata:
    """One batch's plan: the index arrays, and the wrappers planned for it so far."""

    plan: PagedKVPlan
    planned: dict[PlanKey, Any] = field(default_factory=dict)
    #: set by :meth:`FlashInferAttentionBackend.graph_inputs`: the batch is planned into the
    #: CUDA-graph wrappers of this batch size
    graph_bs: int | None = None


class FlashInferAttentionBackend(BaseAttentionBackend):
    """Extend and decode attention on flashinfer's paged kernels: GQA, sliding window,
    soft-capping and token trees, in float16 or bfloat16."""

    name = "flashinfer"
    supports_tree_mask = True

    def __init__(self, *, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 device: torch.device) -> None:
        super().__init__(kv_pool=kv_pool, req_to_token_pool=req_to_token_pool, device=device)
        self._require_cuda(torch.device(device))
        check_dtypes(kv_pool.dtype, kv_pool.dtype)
        self.flashinfer = import_flashinfer()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        #: one wrapper per (mode, kind, dtypes, CUDA-graph batch size or None), kept across
        #: batches, planned again for each
        self._wrappers: dict[tuple[ForwardMode, PlanKey, int | None], Any] = {}
        #: every plan key a layer has asked for, in order (a dict as an ordered set)
        self._kinds: dict[PlanKey, None] = {}
        #: the CUDA-graph wrappers' fixed buffers, by batch size (the indices one is shared)
        self._graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _require_cuda(device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend runs on NVIDIA GPUs only, the "
                             f"device is {device}: use --attention-backend torch on CPU")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = FlashInferMetadata(
            plan_paged_kv(batch, self.req_to_token_pool.req_to_token))

    def _graph_buffer_set(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(indptr [bs + 1], indices, last_page_len [bs])`` for the graph wrappers of ``bs``
        rows. The indices buffer holds ``bs`` whole contexts, and is shared with every smaller
        batch size (the runner captures the largest first; wrappers never run at once)."""
        if bs not in self._graph_buffers:
            need = bs * self.req_to_token_pool.max_context_len
            shared = max((b[1] for b in self._graph_buffers.values()), key=len, default=None)
            if shared is None or len(shared) < need:
                shared = torch.zeros(need, dtype=torch.int32, device=self.device)
            self._graph_buffers[bs] = (
                torch.zeros(bs + 1, dtype=torch.int32, device=self.device), shared,
                torch.ones(bs, dtype=torch.int32, device=self.device))
        return self._graph_buffers[bs]

    def _wrapper(self, mode: ForwardMode, key: PlanKey, graph_bs: int | None) -> Any:
        wrapper = self._wrappers.get((mode, key, graph_bs))
        if wrapper is None:
            fi, kind = self.flashinfer, key[0]
            if mode == ForwardMode.DECODE:
                tensor_cores = kind.num_qo_heads // kind.num_kv_heads >= TENSOR_CORE_GROUP
                graph: dict[str, Any] = {}
                if graph_bs is not None:
                    indptr, indices, last_page_len = self._graph_buffer_set(graph_bs)
                    graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                                 paged_kv_indices_buffer=indices,
                                 paged_kv_last_page_len_buffer=last_page_len)
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=tensor_cores, **graph)
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self._wrappers[(mode, key, graph_bs)] = wrapper
        return wrapper

    def _plan(self, meta: FlashInferMetadata, key: PlanKey) -> Any:
        """Plan ``key``'s wrapper for the batch of ``meta`` (host work, outside any graph)."""
        check_dtypes(key[1], key[2])
        plan = meta.plan
        wrapper = self._wrapper(plan.mode, key, meta.graph_bs)
        make_args = decode_plan_args if plan.mode == ForwardMode.DECODE else prefill_plan_args
        args, kwargs = make_args(plan, *key)
        wrapper.plan(*args, **kwargs)
        meta.planned[key] = wrapper
        self._kinds.setdefault(key)
        return wrapper

    def graph_inputs(self, batch: ForwardBatch) -> list[torch.Tensor] | None:
        """A decode batch to capture or replay: plan it into the CUDA-graph wrappers of its batch
        size for every layer kind seen so far (a kind first met in the capture's warm-up forward
        is planned there); their fixed buffers now hold its indices, so there is nothing to copy:
        ``[]``. None for an extend batch."""
        meta = batch.attn_metadata
        if not isinstance(meta, FlashInferMetadata) or meta.plan.mode != ForwardMode.DECODE:
            return None
        meta.graph_bs = meta.plan.batch_size
        meta.planned.clear()
        for key in self._kinds:
            self._plan(meta, key)
        return []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, FlashInferMetadata):
            raise RuntimeError("init_forward_metadata(batch) must run before the first layer")
        tokens = q.shape[0]
        k_pool = self.kv_pool.k_buffer[layer.layer_id]
        v_pool = self.kv_pool.v_buffer[layer.layer_id]
        self.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc,
                            k.view(tokens, layer.num_kv_heads, layer.head_dim),
                            v.view(tokens, layer.num_kv_heads, -1))
        key = (layer_kind(layer), q.dtype, k_pool.dtype)
        wrapper = meta.planned.get(key)
        if wrapper is None:  # the first layer of its kind in this batch
            wrapper = self._plan(meta, key)
        out = wrapper.run(q.reshape(tokens, layer.num_heads, layer.head_dim),
                          paged_kv_cache(k_pool, v_pool))
        return out.reshape(tokens, -1)
