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
``graph_inputs`` stays None: sgl replays recorded forwards only on CPU, and flashinfer's
``plan`` copies the indices into the wrapper's own buffers, which a CUDA graph would need fixed
(``use_cuda_graph=True`` with preallocated buffers); that is not done.
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


@dataclass
class FlashInferMetadata:
    """One batch's plan: the index arrays, and the wrappers planned for it so far."""

    plan: PagedKVPlan
    planned: dict[tuple[LayerKind, torch.dtype, torch.dtype], Any] = field(default_factory=dict)


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
        #: one wrapper per (mode, kind, dtypes), kept across batches, re-planned per batch
        self._wrappers: dict[tuple[ForwardMode, LayerKind, torch.dtype, torch.dtype], Any] = {}

    @staticmethod
    def _require_cuda(device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend runs on NVIDIA GPUs only, the "
                             f"device is {device}: use --attention-backend torch on CPU")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = FlashInferMetadata(
            plan_paged_kv(batch, self.req_to_token_pool.req_to_token))

    def _wrapper(self, mode: ForwardMode, kind: LayerKind, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> Any:
        key = (mode, kind, q_dtype, kv_dtype)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            fi = self.flashinfer
            if mode == ForwardMode.DECODE:
                tensor_cores = kind.num_qo_heads // kind.num_kv_heads >= TENSOR_CORE_GROUP
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=tensor_cores)
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self._wrappers[key] = wrapper
        return wrapper

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
        kind = layer_kind(layer)
        key = (kind, q.dtype, k_pool.dtype)
        wrapper = meta.planned.get(key)
        if wrapper is None:
            check_dtypes(q.dtype, k_pool.dtype)
            plan = meta.plan
            wrapper = self._wrapper(plan.mode, *key)
            make_args = decode_plan_args if plan.mode == ForwardMode.DECODE else prefill_plan_args
            args, kwargs = make_args(plan, *key)
            wrapper.plan(*args, **kwargs)
            meta.planned[key] = wrapper
        out = wrapper.run(q.reshape(tokens, layer.num_heads, layer.head_dim),
                          paged_kv_cache(k_pool, v_pool))
        return out.reshape(tokens, -1)
