"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from sgl.forward_batch import ForwardBatch
    from sgl.kvcache.pool import KVPool, ReqToTokenPool

__all__ = ["AttentionLayerSpec", "BaseAttentionBackend"]


@dataclass(frozen=True)
class AttentionLayerSpec:
    """The static shape of one attention layer, as the model declares it."""

    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # key/value heads on this rank
    head_dim: int
    scaling: float  # usually head_dim ** -0.5
    sliding_window: int | None = None  # attend to at most this many previous tokens
    logit_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)


class BaseAttentionBackend(ABC):
    """Computes attention over the paged KV pool for ragged batches.

    The model runner builds one backend per process with the pools it owns, calls
    :meth:`init_forward_metadata` once per forward pass (plan indices, masks, kernel work lists),
    then every attention layer calls :meth:`forward`. ``forward`` must first write the new
    ``k``/``v`` into the pool at ``batch.out_cache_loc`` and then attend each new query token to
    its sequence's cached prefix plus the new tokens up to itself (causal). With
    ``batch.tree_masks`` (backends with :attr:`supports_tree_mask`), a sequence's new tokens
    form a tree instead: new token i attends the prefix and the new tokens j where
    ``tree_masks[s][i, j]``.
    """

    #: short name, as registered
    name: str = "base"
    #: whether :meth:`forward` honours ``batch.tree_masks`` (token trees, for verifying a
    #: speculative draft tree in one forward); a batch with tree masks is refused otherwise
    supports_tree_mask: bool = False

    def __init__(self, *, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 device: torch.device) -> None:
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.device = device

    def init_forward_metadata(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Prepare per-batch state before the first layer runs. Default: nothing."""

    def graph_inputs(self, batch: ForwardBatch) -> list[torch.Tensor] | None:
        """The per-batch tensors this backend's kernels read during ``batch``'s forward, for
        replaying a recorded decode forward: the CPU kernel library's replays
        (:meth:`~sgl.kernels.library.KernelLibrary.decode_graphs`) and CUDA graphs (:mod:`sgl.engine.cuda_graph`); called after
        :meth:`init_forward_metadata`.

        The runner records one decode forward of a batch size and, for a later batch of the same
        size, copies that batch's tensors (same order, same shapes) into the recorded ones and
        replays the kernel calls. Return every per-batch tensor a kernel gets a pointer to
        (persistent ones such as the pools need not be listed), with shapes that depend on the
        batch size alone; the kernels must decide nothing from host values of the batch (a
        CUDA graph's launches are fixed at capture). Default: None, the forward of this backend
        is never replayed (on a GPU it then decodes without CUDA graphs)."""
        return None

    def decode_matches_prefill(self, layers: Sequence[AttentionLayerSpec],
                               dtype: torch.dtype) -> bool:
        """Whether a token attended in a decode step gets the same bits, for these layers in
        ``dtype``, as the same token in a prefill or extend (with any cached prefix, any other
        sequences beside it). Then the KV a request's answer leaves equals what a prefill of the
        same text writes, and the scheduler lets the prefix cache keep finished answers for
        later prompts that hold them (a chat's next turn); otherwise it keeps their prompts
        only, so that greedy output does not depend on what the cache held
        (docs/kernels.md, "Batch invariance"). Default: False."""
        return False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """Attention of one layer.

        :param q: ``[num_tokens, num_heads * head_dim]``
        :param k: ``[num_tokens, num_kv_heads * head_dim]`` for the new tokens
        :param v: ``[num_tokens, num_kv_heads * head_dim]`` for the new tokens
        :return: ``[num_tokens, num_heads * head_dim]``
        """
